"""Argument types of `engine plan`: numbers and sizes that must make sense, as argparse errors naming the flag."""

from __future__ import annotations

import argparse
import math

from engine.arg_utils import parse_bytes


def _number(kind: str, ok, convert):
    def parse(text: str):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from None
        if not math.isfinite(value) or not ok(value):  # inf (or 1e400) sized nothing: it overflowed later
            raise argparse.ArgumentTypeError(f"must be {kind} (finite), got {text!r}")
        return convert(value)

    return parse


# Counts accept 1.5e11; sizes and rates are floats.
positive_int = _number("a positive integer", lambda v: v > 0 and v.is_integer(), int)
positive_float = _number("a positive number", lambda v: v > 0, float)
fraction = _number("a fraction in (0, 1]", lambda v: 0 < v <= 1, float)
share = _number("a fraction in [0, 1]", lambda v: 0 <= v <= 1, float)
bandwidth = _number("a positive bandwidth (a link of 0 GB/s never finishes a collective)", lambda v: v > 0, float)


def positive_bytes(text: str) -> int:
    value = parse_bytes(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive size such as 1.5GiB, got {text!r}")
    return value
