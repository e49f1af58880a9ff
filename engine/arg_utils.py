"""Command-line flags for every EngineConfig field, generated from the dataclass so that a new
knob appears in `engine serve`, `engine generate` and `engine bench` without further edits."""

from __future__ import annotations

import argparse
import re
import typing
from dataclasses import MISSING, fields

from engine.config import ATTENTION_BACKENDS, DEVICES, DTYPES, EngineConfig

_CHOICES = {"dtype": DTYPES, "kv_cache_dtype": DTYPES, "device": DEVICES, "attention_backend": ATTENTION_BACKENDS}
_HELP = {
    "model": "model folder (config.json + *.safetensors) or .gguf file; default: the embedded SmolLM2-135M-Instruct",
    "kv_cache_memory": "KV cache budget on CPU, bytes or with a unit (e.g. 4GiB, 512MiB)",
    "num_kv_blocks": "fixed number of KV blocks (overrides the memory budget)",
}
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "kb": 10**3, "mib": 1 << 20, "mb": 10**6, "gib": 1 << 30, "gb": 10**9}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use bytes or a unit such as 4GiB or 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _base_type(annotation) -> type:
    hints = {"int": int, "float": float, "str": str, "bool": bool}
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    for name, t in hints.items():
        if re.search(rf"\b{name}\b", text):
            return t
    return str


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("engine")
    for f in fields(EngineConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        kind = _base_type(f.type)
        help_text = _HELP.get(f.name, f"(default: {default})")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif f.name == "kv_cache_memory":
            group.add_argument(flag, type=parse_bytes, default=default, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=default, choices=_CHOICES.get(f.name), help=help_text)


def engine_config_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields present on `args` (as parsed by add_engine_args)."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**engine_config_kwargs(args))
