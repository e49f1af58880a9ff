"""Tool calling for /v1/chat/completions, as OpenAI specifies it and vLLM serves it.

What a request's `tools` and `tool_choice` turn into (`plan`):
- "none" (or no tools): plain generation; the tools still reach the chat template.
- a named function: the output is constrained to the function's parameters schema (structured
  output), and all of it is that call's `arguments`: always parses, streams as it is generated.
- "required": the output is constrained to a JSON array of calls, [{"name": ..., "parameters":
  {...}}, ...] (one at most unless parallel_tool_calls), each against its function's schema.
- "auto": free generation, then the server's `--tool-call-parser` finds calls in the text
  (needs `--enable-auto-tool-choice`, as in vLLM): hermes / Qwen `<tool_call>{json}</tool_call>`
  blocks, Llama 3's bare JSON object(s) `{"name": ..., "parameters": {...}}`, or the formats of
  server/tool_formats.py (mistral's `[TOOL_CALLS]`, pythonic lists, qwen3_coder's XML-like blocks,
  gpt-oss's messages to functions).

Streamed, every mode sends each call's id and name once the name is complete, then its
arguments' text as it is generated (`partial_calls` follows the growing text).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from engine.sampling_params import GrammarSpec, RequestError
from server import tool_formats

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "openai")
# Parsers whose marker is a special token: the reply is detokenized with special tokens.
READS_SPECIAL_TOKENS = ("mistral", "openai")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
HERMES_START = "<tool_call>"
LLAMA_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolConfig:
    """The server's flags for reading a chat reply's text: --enable-auto-tool-choice and
    --tool-call-parser, and --reasoning-parser (server/reasoning/), whose answer part is where
    tool calls are read."""

    enable_auto: bool = False
    parser: str | None = None
    reasoning_parser: str | None = None


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"


def call_id(parser: str | None) -> str:
    """A new call's id: Mistral's templates require 9 letters and digits of the ids sent back."""
    return uuid.uuid4().hex[:9] if parser == "mistral" else f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Plan:
    mode: str  # none | named | required | auto
    grammar: GrammarSpec | None = None
    name: str | None = None  # the named function
    functions: dict | None = None  # "auto": name -> parameters schema (qwen3_coder reads its values' types)
    special_tokens: bool = False  # the parser reads a special token's text: detokenize with them


def _functions(tools: list) -> dict[str, dict]:
    """name -> parameters schema of protocol.Tool entries; raises a RequestError naming the field."""
    out = {}
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in out:
            raise RequestError(f"tools[{i}].function.name", f": {fn.name!r} names an earlier function too: give each "
                             "function its own name")
        out[fn.name] = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
    return out


def plan(tools: list | None, tool_choice, parallel: bool | None, config: ToolConfig) -> Plan:
    """What a request's tools (protocol.Tool list) and tool_choice ("none", "auto", "required" or a
    protocol.NamedToolChoice; shapes checked at the edge) ask for; a RequestError (naming the field) if
    they cannot be served."""
    functions = _functions(tools or [])
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return Plan("none")
    if not functions:
        raise RequestError("tool_choice", " needs tools: give the functions the model may call")
    if not isinstance(tool_choice, str):
        name = tool_choice.function.name
        if name not in functions:
            raise RequestError("tool_choice", f" names function {name[:100]!r}, which is not in tools "
                             f"({', '.join(functions)[:400]})")
        return Plan("named", GrammarSpec.of("json", functions[name], field="tools"), name)
    if tool_choice == "required":
        calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                            "required": ["name", "parameters"], "additionalProperties": False}
                           for n, p in functions.items()]}
        schema = {"type": "array", "items": calls, "minItems": 1}
        if parallel is False:
            schema["maxItems"] = 1
        return Plan("required", GrammarSpec.of("json", schema, field="tools"))
    if tool_choice == "auto":
        if not (config.enable_auto and config.parser):
            raise RequestError("tool_choice", " 'auto' needs the server started with --enable-auto-tool-choice and "
                             "--tool-call-parser (or use 'required' or a named function)")
        return Plan("auto", functions=functions, special_tokens=config.parser in READS_SPECIAL_TOKENS)
    raise RequestError("tool_choice", f" must be none, auto, required or {{'type': 'function', 'function': "
                     f"{{'name': ...}}}}, got {str(tool_choice)[:100]!r}")


def calls_from_text(p: Plan, text: str, parser: str | None) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished choice's text."""
    if p.mode == "named":
        return None, [ToolCall(p.name, text, call_id(parser))]
    if p.mode == "required":
        # The arguments as generated, as a stream sends them; a call cut short (max_tokens, a stop
        # string) keeps what was generated of them, as streamed; text cut before the first call's
        # name is complete is content, as streamed.
        calls = partial_calls("required", None, text)
        return (None, [ToolCall(c.name, c.arguments, call_id(parser)) for c in calls]) if calls else (text, [])
    if p.mode == "auto":
        return parse(parser, text, p.functions)
    return text, []


def parse(parser: str, text: str, functions: dict | None = None) -> tuple[str | None, list[ToolCall]]:
    """Find tool calls in free text with `parser`; text that holds none is all content.
    `functions`: name -> parameters schema of the request's tools."""
    if parser == "hermes":
        calls = []
        for block in _HERMES.findall(text):
            call = _call(block)
            if call is None:
                return text, []  # a malformed block: leave the text to the client, as it is
            calls.append(call)
        if not calls:
            return text, []
        content = _HERMES.sub("", text).strip()
        return content or None, calls
    if parser == "llama3_json":
        body = text.strip().removeprefix(LLAMA_TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls = [_call(part) for part in _split_json_objects(body)]
        if not calls or any(c is None for c in calls):
            return text, []
        return None, calls
    if parser == "mistral":
        found = tool_formats.mistral(text)
        if not found or not found[1]:
            return text, []
        return found[0], [ToolCall(name, args, call_id(parser)) for name, args in found[1]]
    if parser == "openai":
        content, found = tool_formats.harmony(text)
        return (content, [ToolCall(name, _compact(args)) for name, args, _ in found]) if found else (text, [])
    if parser == "qwen3_coder":
        found = tool_formats.qwen3_coder(text, functions or {})
        return (found[0], [ToolCall(name, args) for name, args in found[1]]) if found else (text, [])
    if parser == "pythonic":
        found = tool_formats.pythonic(text)
        return (None, [ToolCall(name, args) for name, args in found]) if found else (text, [])
    raise ValueError(f"unknown tool-call parser {parser!r}: one of {', '.join(PARSERS)}")


def _compact(arguments: str) -> str:
    """JSON arguments as JSON, re-serialised; other text as it is."""
    try:
        return json.dumps(json.loads(arguments))
    except json.JSONDecodeError:
        return arguments


def _call(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _split_json_objects(text: str) -> list[str]:
    """Llama 3 may write several calls one after another, separated by ';' or whitespace."""
    decoder, parts, i = json.JSONDecoder(), [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \n\t;":
            i += 1
        if i == len(text):
            break
        try:
            _, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return [text]  # not a sequence of objects: _call fails on it and the text stays content
        parts.append(text[i:end])
        i = end
    return parts


def may_start_call(parser: str, text: str) -> int:
    """Streaming with "auto": how much of `text` (the choice's text so far) is surely content. A
    call's start, or what could still become one, is held back until the choice ends."""
    if parser in ("hermes", "qwen3_coder", "mistral", "openai"):
        marker = {"hermes": HERMES_START, "qwen3_coder": HERMES_START, "mistral": tool_formats.MISTRAL_START,
                  "openai": tool_formats.HARMONY_START}[parser]
        at = text.find(marker)
        if at >= 0:
            return at
        for k in range(min(len(marker) - 1, len(text)), 0, -1):  # a partial marker at the end
            if marker.startswith(text[-k:]):
                return len(text) - k
        return len(text)
    if parser == "pythonic":
        return 0 if tool_formats.pythonic_may_start(text) else len(text)
    stripped = text.lstrip()
    if not stripped or stripped[0] == "{" or LLAMA_TAG.startswith(stripped[:len(LLAMA_TAG)]):
        return 0  # a Llama 3 call is the whole message
    return len(text)


# ---- streaming: calls as they are generated -------------------------------------------------------

_NAME = re.compile(r'\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass
class PartialCall:
    name: str
    arguments: str  # the arguments object's text so far
    complete: bool


def partial_calls(mode: str, parser: str | None, text: str) -> list[PartialCall]:
    """The calls in a choice's text so far, each once its name is known, with as much of its
    arguments' text as has been generated: "required" arrays, hermes <tool_call> blocks, Llama 3
    objects and mistral's JSON arrays, written name first (as these models, and the "required"
    grammar, write them), and mistral's name{arguments}. Pythonic and qwen3_coder calls come whole at the end."""
    if mode == "auto" and parser == "openai":
        return _harmony_partial(text)
    if mode == "auto" and parser == "mistral":
        at = text.find(tool_formats.MISTRAL_START)
        after = at + len(tool_formats.MISTRAL_START)
        if at >= 0 and not text[after:].lstrip().startswith("["):
            return _mistral_partial(text)
        starts = _object_starts(text, text.index("[", after) + 1) if at >= 0 and "[" in text[after:] else []
    elif mode == "required":
        starts = _object_starts(text, text.find("[") + 1) if text.lstrip().startswith("[") else []
    elif mode == "auto" and parser == "hermes":
        starts = [text.index("{", i) for i in _marker_ends(text) if "{" in text[i:]]
    elif mode == "auto" and parser == "llama3_json":
        body = text.lstrip()
        offset = len(text) - len(body) + (len(LLAMA_TAG) if body.startswith(LLAMA_TAG) else 0)
        starts = _object_starts(text, offset) if text[offset:].lstrip().startswith("{") else []
    else:
        return []
    calls = []
    for start in starts:
        m = _NAME.match(text, start + 1)
        if m is None or m.end() >= len(text) or text[m.end()] != "{":
            break  # the name (or the start of the arguments) is not complete yet
        end, complete = _value_end(text, m.end())
        calls.append(PartialCall(json.loads(f'"{m.group(1)}"'), text[m.end():end], complete))
        if not complete:
            break
    return calls


def _harmony_partial(text: str) -> list[PartialCall]:
    calls = []
    for name, args, start in tool_formats.harmony(text)[1]:
        if not args.lstrip().startswith("{"):
            break  # not JSON (or not begun): the call comes whole at the end
        end, complete = _value_end(text, start + len(args) - len(args.lstrip()))
        calls.append(PartialCall(name, text[start + len(args) - len(args.lstrip()):end], complete))
        if not complete:
            break
    return calls


def _mistral_partial(text: str) -> list[PartialCall]:
    calls = []
    for name, start in tool_formats.mistral_partial(text):
        end, complete = _value_end(text, start)
        calls.append(PartialCall(name, text[start:end], complete))
        if not complete:
            break
    return calls


def _marker_ends(text: str) -> list[int]:
    out, i = [], text.find(HERMES_START)
    while i >= 0:
        out.append(i + len(HERMES_START))
        i = text.find(HERMES_START, i + 1)
    return out


def _brackets(text: str, start: int):
    """(index, bracket, depth) of each bracket outside a JSON string, from `start` on: the depth an
    opening bracket opens from, the depth a closing one returns to. 0 is `start`'s own level; a
    bracket closing one opened before `start` goes below it."""
    level, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            yield i, ch, level
            level += 1
        elif ch in "}]":
            level -= 1
            yield i, ch, level


def _object_starts(text: str, start: int) -> list[int]:
    """Where each object at the nesting level of `start` begins (up to the bracket closing that level)."""
    starts = []
    for i, ch, level in _brackets(text, start):
        if level < 0:
            break
        if ch == "{" and level == 0:
            starts.append(i)
    return starts


def _value_end(text: str, start: int) -> tuple[int, bool]:
    """The end of the JSON object starting at `start`, and whether it is complete."""
    for i, ch, level in _brackets(text, start):
        if ch in "}]" and level == 0:
            return i + 1, True
    return len(text), False
