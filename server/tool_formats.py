"""Tool calls written in formats other than a JSON object per call (server/tool_calls.py reads
those): Mistral's `[TOOL_CALLS]` and the pythonic list of Llama 3.2 / Llama 4, as vLLM's
`mistral` and `pythonic` parsers read them.

- mistral: content, then `[TOOL_CALLS]` and the calls, either as a JSON array
  `[{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3 and the templates of its era) or
  each as `[TOOL_CALLS]name{json arguments}` (the v11 tokenizers'). `[TOOL_CALLS]` is a special
  token, so the reply is detokenized with special tokens for it. Call ids are 9 letters and
  digits, which Mistral's templates require of the ids sent back.
- pythonic: the whole reply is a Python list of calls with literal keyword arguments,
  `[get_weather(city="Rome", days=3), ...]` (Llama 4 may wrap it in <|python_start|>...<|python_end|>).
- qwen3_coder (Qwen3-Coder, Qwen3.5): content, then `<tool_call><function=NAME><parameter=P>value
  </parameter>...</function></tool_call>` blocks (newlines around each part); a value is text,
  read by its parameter's type in the function's schema (integer, number, boolean, object and
  array from their text; "null" is null; a string or an unknown parameter as it is).
- openai (gpt-oss, with --reasoning-parser gpt_oss, which hands each message to a function over
  as `<|channel|>commentary to=functions.NAME<|message|>` and its arguments): each such message is
  a call; the final channel's text is the content.
"""

from __future__ import annotations

import ast
import json
import re

MISTRAL_START = "[TOOL_CALLS]"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_MISTRAL_NAME = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?=\{)")
HARMONY_START = "<|channel|>"
_HARMONY_CALL = re.compile(r"<\|channel\|>commentary to=functions\.([^\s<]+)<\|message\|>")


def mistral(text: str) -> tuple[str | None, list[tuple[str, str]]] | None:
    """(content, [(name, arguments JSON)]) of a reply, or None when it holds no well-formed calls."""
    if MISTRAL_START not in text:
        return None
    content, *parts = text.split(MISTRAL_START)
    decoder, calls = json.JSONDecoder(), []
    for part in parts:
        body = part.strip()
        if body.startswith("["):  # the JSON-array form
            try:
                items = json.loads(body)
            except json.JSONDecodeError:
                return None
            if not isinstance(items, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("name"), str) for c in items):
                return None
            calls += [(c["name"], _arguments(c.get("arguments", {}))) for c in items]
            continue
        i = 0
        while i < len(body):  # name{arguments}, one or more
            m = _MISTRAL_NAME.match(body, i)
            if m is None:
                return None
            try:
                args, i = decoder.raw_decode(body, m.end())
            except json.JSONDecodeError:
                return None
            calls.append((m.group(1), _arguments(args)))
            while i < len(body) and body[i] in " \n\t,":
                i += 1
    return (content if content.strip() else None), calls


def mistral_partial(text: str) -> list[tuple[str, int]]:
    """Streaming, the `name{...}` form: (name, where its arguments start) of each call whose name
    is complete (the JSON-array form is scanned as JSON objects by the caller)."""
    out, at = [], text.find(MISTRAL_START)
    while at >= 0:
        m = _MISTRAL_NAME.match(text, at + len(MISTRAL_START))
        if m is None:
            break
        out.append((m.group(1), m.end()))
        at = text.find(MISTRAL_START, m.end())
    return out


def harmony(text: str) -> tuple[str | None, list[tuple[str, str, int]]]:
    """(content, [(name, arguments, where the arguments start)]) of the answer part of a gpt-oss
    reply; a call's arguments run to the next call or the end."""
    matches = list(_HARMONY_CALL.finditer(text))
    ends = [m.start() for m in matches[1:]] + [len(text)]
    calls = [(m.group(1), text[m.end():end], m.end()) for m, end in zip(matches, ends)]
    content = text[:matches[0].start()] if matches else text
    return (content if content.strip() or not matches else None), calls


_CODER_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_CODER_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)
CODER_START = "<tool_call>"


def qwen3_coder(text: str, functions: dict[str, dict]) -> tuple[str | None, list[tuple[str, str]]] | None:
    """(content, [(name, arguments JSON)]) of a reply, or None when it holds no call.
    `functions`: name -> parameters schema, for the values' types."""
    if "<function=" not in text:
        return None
    at = text.find(CODER_START)
    content = text[:at if at >= 0 else text.find("<function=")]
    calls = []
    for name, body in _CODER_FUNCTION.findall(text):
        properties = (functions.get(name) or {}).get("properties") or {}
        args = {p: _typed(v.removeprefix("\n").removesuffix("\n"), properties.get(p))
                for p, v in _CODER_PARAMETER.findall(body)}
        calls.append((name, json.dumps(args, ensure_ascii=False)))
    return (content if content.strip() else None), calls


def _typed(value: str, schema: dict | None):
    """A qwen3_coder parameter's text as its schema's type says (as it is where that fails)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if value.lower() == "null":
        return None
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            number = float(value)
            return int(number) if number.is_integer() else number
        if kind == "boolean":
            return {"true": True, "false": False}.get(value.lower(), value)
        if kind in ("object", "array"):
            return json.loads(value)
    except ValueError:  # json.JSONDecodeError is one
        pass
    return value


def pythonic(text: str) -> list[tuple[str, str]] | None:
    """[(name, arguments JSON)] of a reply that is a list of calls, or None."""
    body = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    if not (body.startswith("[") and body.endswith("]")):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for call in tree.elts:
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)) or call.args:
            return None  # only name(keyword=literal, ...)
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg is not None}
        except ValueError:
            return None
        calls.append((call.func.id, _arguments(args)))
    return calls


def pythonic_may_start(text: str) -> bool:
    """Whether `text` (stripped) may still become a pythonic call list."""
    body = text.strip()
    return not body or body.startswith("[") or PYTHON_START.startswith(body[:len(PYTHON_START)])


def _arguments(args) -> str:
    try:
        return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    except TypeError:  # a literal JSON has no form for (a set, bytes): its text
        return json.dumps(repr(args))
