"""The mistral, pythonic, qwen3_coder and openai (gpt-oss) tool-call parsers
(server/tool_formats.py) on texts written as those models write them, whole and as they grow:
every prefix's streamed calls (name, arguments so far) and released content are prefixes of what
the whole text gives. Live, through a server and the official openai client, with a grammar
making the tiny model write the call (gpt-oss's live test is tests/server/test_reasoning_live.py's,
its calls coming through the gpt_oss reasoning parser)."""

from __future__ import annotations

import json
import re

import pytest

from server import tool_calls
from tests.server.server_harness import API_KEY, TINY_SERVER_ARGS, ServerProcess

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}

WHOLE = [
    # (parser, text, content, [(name, arguments)])
    ("mistral", 'Let me check.[TOOL_CALLS]get_weather{"city": "Rome", "days": 3}', "Let me check.",
     [("get_weather", {"city": "Rome", "days": 3})]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Rome"}[TOOL_CALLS]get_time{"tz": "CET"}', None,
     [("get_weather", {"city": "Rome"}), ("get_time", {"tz": "CET"})]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]', None,
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ("mistral", "No call, just [brackets].", "No call, just [brackets].", []),
    ("mistral", "[TOOL_CALLS]get_weather{broken", "[TOOL_CALLS]get_weather{broken", []),  # left to the client
    ("openai", '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Rome", "days": 3}', None,
     [("get_weather", {"city": "Rome", "days": 3})]),
    ("openai", 'Sure.<|channel|>commentary to=functions.get_time<|message|>{}'
               '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Rome"}', "Sure.",
     [("get_time", {}), ("get_weather", {"city": "Rome"})]),
    ("openai", "No call here.", "No call here.", []),
    ("qwen3_coder", "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan José\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n<parameter=when>\nnull\n</parameter>\n</function>\n"
                    "</tool_call>", "I'll look.\n", [("get_weather", {"city": "San José", "days": 3, "when": None})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=x>\n"
                    "[1]\n</parameter>\n</function>\n</tool_call>", None,
     [("get_weather", {"days": "three", "x": "[1]"})]),  # not an integer; not in the schema: the text
    ("qwen3_coder", "Plain <b>text</b>.", "Plain <b>text</b>.", []),
    ("pythonic", '[get_weather(city="Rome", days=3), get_time(tz=None, opts={"a": [1, -2.5]})]', None,
     [("get_weather", {"city": "Rome", "days": 3}), ("get_time", {"tz": None, "opts": {"a": [1, -2.5]}})]),
    ("pythonic", '<|python_start|>[get_time()]<|python_end|>', None, [("get_time", {})]),
    ("pythonic", "It is [sunny] today.", "It is [sunny] today.", []),
    ("pythonic", '[get_weather("Rome")]', '[get_weather("Rome")]', []),  # positional: not a call form
    ("pythonic", '[get_weather(city=open("x"))]', '[get_weather(city=open("x"))]', []),  # not a literal
]


@pytest.mark.parametrize("parser,text,content,calls", WHOLE)
def test_whole_text(parser, text, content, calls):
    got_content, got = tool_calls.parse(parser, text, {"get_weather": WEATHER["function"]["parameters"]})
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    if parser == "mistral":
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in got)  # what Mistral's templates accept


@pytest.mark.parametrize("parser,text,content,calls", [w for w in WHOLE if w[3]])
def test_every_prefix_streams_a_prefix_of_the_whole(parser, text, content, calls):
    final = tool_calls.parse(parser, text, {"get_weather": WEATHER["function"]["parameters"]})[1]
    for i in range(len(text) + 1):
        prefix = text[:i]
        released = prefix[:tool_calls.may_start_call(parser, prefix)]
        assert (content or "").startswith(released), prefix
        for got, want in zip(tool_calls.partial_calls("auto", parser, prefix), final, strict=False):
            assert got.name == want.name and want.arguments.replace(" ", "").startswith(
                got.arguments.replace(" ", "")), prefix
    assert tool_calls.may_start_call(parser, text) <= len(content or "")


def test_mistral_asks_for_special_tokens():
    config = tool_calls.ToolConfig(True, "mistral")
    assert tool_calls.plan([_tool()], "auto", None, config).special_tokens
    assert not tool_calls.plan([_tool()], "auto", None, tool_calls.ToolConfig(True, "hermes")).special_tokens


def _tool():
    from server.protocol import Tool

    return Tool.model_validate(WEATHER)


# ---- live: the official client, whole and streamed ---------------------------------------------------

LIVE = {"mistral": ('Checking.[TOOL_CALLS]get_weather{"city": "Rome", "days": 3}', "Checking."),
        "pythonic": ('[get_weather(city="Rome", days=3)]', None),
        "qwen3_coder": ("On it.<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
                        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", "On it.")}


@pytest.mark.slow  # a server per parser (~8 s each)
@pytest.mark.parametrize("parser", sorted(LIVE))
def test_live_whole_and_streamed(parser, tiny_model_dir, tmp_path):
    import openai

    text, content = LIVE[parser]
    args = [a for a in TINY_SERVER_ARGS if a != "hermes"]
    args[args.index("--tool-call-parser") + 1:args.index("--tool-call-parser") + 1] = [parser]
    proc = ServerProcess(["--model", tiny_model_dir, "--api-key", API_KEY, *args], str(tmp_path / "server.log"))
    forced = {"structured_outputs": {"regex": re.escape(text)}}
    try:
        with openai.OpenAI(base_url=proc.base_url, api_key=API_KEY, max_retries=0, timeout=60) as client:
            kw = dict(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Weather?"}],
                      tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=200, extra_body=forced)
            whole = client.chat.completions.create(**kw)
            message = whole.choices[0].message
            assert whole.choices[0].finish_reason == "tool_calls" and message.content == content
            assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls] == [
                ("get_weather", {"city": "Rome", "days": 3})]
            streamed, calls = "", {}
            for chunk in client.chat.completions.create(stream=True, **kw):
                for choice in chunk.choices:
                    streamed += choice.delta.content or ""
                    for t in choice.delta.tool_calls or []:
                        call = calls.setdefault(t.index, {"id": t.id, "name": "", "arguments": ""})
                        call["name"] += t.function.name or ""
                        call["arguments"] += t.function.arguments or ""
            assert streamed == (content or "")
            assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
                ("get_weather", {"city": "Rome", "days": 3})]
            if parser == "mistral":
                assert re.fullmatch(r"[A-Za-z0-9]{9}", calls[0]["id"])
    finally:
        proc.stop()
