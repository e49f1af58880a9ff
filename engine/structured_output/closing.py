"""Bounds that let a JSON output close. A grammar allows `"population": 1111...` or a string of one
letter repeated for as long as the model likes, and a small model, greedy, takes that path to
max_tokens. So, unless the schema bounds a value itself (or `json_value_limits` is off):

- integers have at most 18 digits (within a signed 64-bit integer); an integer bounded on one side
  only is bounded on the other at the 64-bit limit;
- numbers have at most 16 integer and 16 fraction digits and a two-digit exponent (a double);
- strings (property names of free objects included) hold at most `string_chars(max_tokens)`
  characters: half max_tokens, rounded down to a power of two, between 16 and 4096.

A schema that sets maxLength, maximum / minimum, a pattern, a format, an enum or a const keeps
its own bounds; only free values get these."""

from __future__ import annotations

import copy
import re

from engine.structured_output.schema import walk

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MIN_STRING_CHARS, MAX_STRING_CHARS = 16, 4096

# xgrammar's rules for a JSON value the schema leaves free, replaced by bounded ones.
_BOUNDED_RULES = {
    "basic_integer": r'(("0") | ("-"? [1-9] [0-9]{0,17}))',
    "basic_number": r'(("-"? ("0" | [1-9] [0-9]{0,15})) ("." [0-9]{1,16})? ([eE] [+\-]? [0-9]{1,2})?)',
    "basic_string": r'(("\"" basic_string_char{0,%d} "\""))',
}
_STRING_CHAR = r'basic_string_char ::= (([^\0-\x1f\"\\\r\n]) | ("\\" basic_escape))'
_STRING_OWN_BOUNDS = ("maxLength", "pattern", "format", "enum", "const")


def string_chars(max_tokens: int | None) -> int:
    """The longest free string for an output of at most max_tokens tokens (None: the longest)."""
    if max_tokens is None:
        return MAX_STRING_CHARS
    half = max(max_tokens // 2, 1)
    return min(max(1 << (half.bit_length() - 1), MIN_STRING_CHARS), MAX_STRING_CHARS)


def _types(node: dict) -> set:
    t = node.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def bound_schema(schema: dict, chars: int) -> dict:
    """A copy of the schema whose half-bounded integers and numbers, and strings with only a
    minLength, get the other bound (fully free ones are bounded in the grammar's own rules)."""
    schema = copy.deepcopy(schema)
    for node in walk(schema):
        types = _types(node)
        for kind, low, high in (("integer", INT64_MIN, INT64_MAX), ("number", -1e15, 1e15)):
            if kind not in types:
                continue
            has_low = "minimum" in node or "exclusiveMinimum" in node
            has_high = "maximum" in node or "exclusiveMaximum" in node
            if has_low and not has_high:
                node["maximum"] = high
            elif has_high and not has_low:
                node["minimum"] = low
        if "string" in types and "minLength" in node and not any(k in node for k in _STRING_OWN_BOUNDS):
            minimum = node["minLength"]
            node["maxLength"] = max(chars, minimum) if isinstance(minimum, int) else chars
    return schema


def bound_free_values(ebnf: str, chars: int) -> str:
    """xgrammar's print of a JSON grammar with its free integers, numbers and strings bounded."""
    for rule, body in _BOUNDED_RULES.items():
        ebnf = re.sub(rf"^{rule} ::= .*$", lambda _: f"{rule} ::= {body.replace('%d', str(chars))}", ebnf,
                      flags=re.M)
    return ebnf + "\n" + _STRING_CHAR + "\n"
