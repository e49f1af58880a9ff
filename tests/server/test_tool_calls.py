"""Tool calling: the parsers and the request plan on their own, then through a real server and
the official openai client: a named function (whole and streamed, arguments validated against
its schema by jsonschema), "required" (parallel and not), "auto" with the hermes parser (the
model's text forced into a call through a regex, then parsed), and a conversation that carries
the calls and the tool's answer into the next turn."""

from __future__ import annotations

import json

import jsonschema
import pytest

from server.protocol import ChatCompletionRequest
from server.tool_calls import Plan, ToolConfig, calls_from_text, may_start_call, parse, partial_calls, plan

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                "unit": {"enum": ["C", "F"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# ---- parsers and plans -------------------------------------------------------------------------------


def test_hermes_parser():
    content, calls = parse("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                     '{"city": "Paris"}}\n</tool_call><tool_call>{"name": "get_time", '
                                     '"arguments": {"zone": "UTC"}}</tool_call>')
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                   ("get_time", {"zone": "UTC"})]
    assert parse("hermes", "no call here") == ("no call here", [])
    broken = "<tool_call>{not json}</tool_call>"
    assert parse("hermes", broken) == (broken, [])


def test_llama3_json_parser():
    _, calls = parse("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                                    '{"name": "get_time", "parameters": {"zone": "CET"}}')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome"}),
                                                                   ("get_time", {"zone": "CET"})]
    assert parse("llama3_json", "Hello {there}") == ("Hello {there}", [])
    assert parse("llama3_json", '{"no": "name"}') == ('{"no": "name"}', [])


def test_streaming_holds_back_what_may_start_a_call():
    assert may_start_call("hermes", "Sure. <tool_c") == len("Sure. ")
    assert may_start_call("hermes", "Sure. <tool_call>{") == len("Sure. ")
    assert may_start_call("hermes", "Sure, 1 < 2.") == len("Sure, 1 < 2.")
    assert may_start_call("llama3_json", ' {"name"') == 0 and may_start_call("llama3_json", "Hi") == 2


def test_partial_calls_follow_the_text_as_it_grows():
    """Every prefix of a text with two calls (strings holding braces, quotes and escapes,
    nested objects): the calls seen so far are prefixes of the final ones, and at the end they are
    the final ones exactly."""
    text = ('[{"name": "a", "parameters": {"s": "x}{\\\"y", "n": {"m": [1, {"k": "]"}]}}}, '
            '{"name": "b", "parameters": {"t": "z"}}]')
    final = [(c.name, c.arguments) for c in partial_calls("required", None, text)]
    assert [n for n, _ in final] == ["a", "b"] and all(c.complete for c in partial_calls("required", None, text))
    assert [json.loads(a) for _, a in final] == [p["parameters"] for p in json.loads(text)]
    for end in range(len(text)):
        seen = partial_calls("required", None, text[:end])
        assert len(seen) <= 2
        for (name, args), got in zip(final, seen):
            assert got.name == name and args.startswith(got.arguments)
    hermes = 'ok <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
    assert [(c.name, c.arguments) for c in partial_calls("auto", "hermes", hermes)] == [("a", '{"x": 1}')]


def _plan(tools, choice, parallel, config):
    """plan() on a request's fields as the server has them: typed at the edge (protocol)."""
    body = ChatCompletionRequest.model_validate({"messages": ASK, "tools": tools, "tool_choice": choice})
    return plan(body.tools, body.tool_choice, parallel, config)


@pytest.mark.parametrize("tools, choice, config, message", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, ToolConfig(), "^tool_choice names"),
    ([WEATHER], "auto", ToolConfig(), "^tool_choice 'auto' needs the server started with"),
    ([], "required", ToolConfig(), "^tool_choice needs tools"),
    ([WEATHER, WEATHER], "required", ToolConfig(), r"^tools\[1\]\.function\.name: 'get_weather' names an earlier"),
])
def test_plan_refuses_what_cannot_be_served(tools, choice, config, message):
    with pytest.raises(ValueError, match=message):
        _plan(tools, choice, None, config)


def test_plan_modes():
    assert _plan(None, None, None, ToolConfig()).mode == "none"
    assert _plan([WEATHER], "none", None, ToolConfig()).mode == "none"
    assert _plan([WEATHER], None, None, ToolConfig(True, "hermes")).mode == "auto"  # tools given: auto by default
    named = _plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None, ToolConfig())
    assert named.mode == "named" and named.name == "get_time" and json.loads(named.grammar.spec) == SCHEMAS["get_time"]
    one = json.loads(_plan([WEATHER], "required", False, ToolConfig()).grammar.spec)
    assert one["maxItems"] == 1 and "maxItems" not in json.loads(_plan([WEATHER], "required", None,
                                                                        ToolConfig()).grammar.spec)
    assert calls_from_text(Plan("required"), '[{"name": "get_time", "parameters": {"zone": "UTC"}}]', None)[1][0] \
        .arguments == '{"zone": "UTC"}'


# ---- through the server ---------------------------------------------------------------------------------


def _streamed_calls(stream) -> tuple[str, dict[int, dict], int, str | None]:
    """(content, {index: {id, name, arguments}}, argument deltas, finish_reason) of a stream, the
    calls assembled from their deltas as a client does."""
    content, calls, pieces, finish = "", {}, 0, None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                assert d.id is None or call["id"] in (None, d.id), "one call's deltas carry one id"
                call["id"] = d.id or call["id"]
                call["name"] = d.function.name or call["name"]
                call["arguments"] += d.function.arguments or ""
                pieces += bool(d.function.arguments)
            finish = ch.finish_reason or finish
    return content, calls, pieces, finish


def _streamed_in_pieces(client, more_than, **request) -> tuple[str, dict[int, dict], int, str | None]:
    """_streamed_calls of `request` streamed, asked up to 3 times until its arguments came in more
    deltas than more_than(calls): the server merges the deltas a lagging client has not read yet (as
    vLLM does), so on a loaded machine a short call can come whole; a stream that never sends the
    arguments as they are generated fails all three."""
    for _ in range(3):
        content, calls, pieces, finish = _streamed_calls(client.chat.completions.create(stream=True, **request))
        if pieces > more_than(calls):
            break
    return content, calls, pieces, finish


def _check(call, name=None):
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_function_whole_and_streamed(client):
    model = client.models.list().data[0].id
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                       max_tokens=60, temperature=1.0, seed=4)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls) == 1
    _check(c.message.tool_calls[0], "get_weather")
    _, calls, pieces, finish = _streamed_in_pieces(client, lambda calls: 1, model=model, messages=ASK,
                                                   tools=[WEATHER, TIME], tool_choice=choice, max_tokens=60,
                                                   temperature=0)
    assert [(c["name"], bool(c["id"])) for c in calls.values()] == [("get_weather", True)] and finish == "tool_calls"
    assert pieces > 1, "the arguments should arrive as they are generated, in several deltas"
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_weather"])


@pytest.mark.parametrize("parallel", [None, False])
def test_required_calls_validate(client, parallel):
    model = client.models.list().data[0].id
    kw = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=400, temperature=1.0, seed=8, **kw)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    assert parallel is None or len(calls) == 1
    for call in calls:
        _check(call)
    _, streamed, pieces, finish = _streamed_in_pieces(
        client, len, model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=400,
        temperature=1.0, seed=8, **kw)
    assert finish == "tool_calls" and pieces > len(streamed)  # arguments in pieces, as generated
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls]  # the same calls, seeded


@pytest.mark.parametrize("cut", [dict(max_tokens=n) for n in (3, 24, 34, 40)] + [dict(max_tokens=60, stop=["}"])])
def test_required_calls_cut_short_are_the_same_streamed_or_not(client, cut):
    """max_tokens or a stop string that cuts the "required" array short: the whole response holds
    what a stream sent (the calls whose names are complete, their arguments as far as generated;
    before that, the text as content) and the same finish_reason. The whole response gave the raw
    text as content where the stream had sent a call."""
    model = client.models.list().data[0].id
    request = dict(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0, **cut)
    r = client.chat.completions.create(**request).choices[0]
    content, calls, _, finish = _streamed_calls(client.chat.completions.create(stream=True, **request))
    whole = [(c.function.name, c.function.arguments) for c in r.message.tool_calls]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == whole
    assert (content or None) == r.message.content and finish == r.finish_reason
    assert finish == ("tool_calls" if whole and "stop" in cut else "length" if "stop" not in cut else "stop")


def test_auto_with_the_hermes_parser_whole_and_streamed(client):
    """The tiny random model never writes a call by itself: a regex (vLLM's structured_outputs)
    makes it write one, and the parser, which knows nothing of the regex, finds it."""
    model = client.models.list().data[0].id
    text = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}</tool_call>'
    force = {"structured_outputs": {"regex": text.replace("{", r"\{").replace("}", r"\}").replace(".", r"\.")}}
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=300, temperature=0,
                                       extra_body=force)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"})]
    content, calls, pieces, finish = _streamed_in_pieces(
        client, lambda calls: 1, model=model, messages=ASK, tools=[WEATHER], max_tokens=300, temperature=0,
        extra_body=force)
    assert content == "Checking." and [c["name"] for c in calls.values()] == ["get_weather"] and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Oslo", "unit": "C"} and finish == "tool_calls"
    assert pieces > 1, "the arguments should arrive as they are generated, in several deltas"
    plain = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls == [] and plain.choices[0].finish_reason in ("stop", "length")


def test_calls_and_answers_go_into_the_next_turn(client):
    model = client.models.list().data[0].id
    first = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=40,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    again = client.chat.completions.create(model=model, messages=turns, tools=[WEATHER], max_tokens=5,
                                           tool_choice="none")
    assert again.choices[0].message.content is not None and again.choices[0].message.tool_calls == []


def test_bad_tool_and_grammar_requests_beside_good_ones(server, client):
    """While a streamed request and a constrained one run, every bad tool, tool_choice and grammar input gets its
    400 naming the field; the good ones finish whole and no KV block stays in use."""
    import threading
    import time

    import httpx

    from tests.server.server_harness import API_KEY, get_metrics, metric

    model = client.models.list().data[0].id
    results = {}

    def good():
        stream = client.chat.completions.create(model=model, messages=ASK, max_tokens=64, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
        results["stream"] = sum(len(ch.choices[0].delta.content or "") > 0 for ch in stream if ch.choices)
        r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=120, temperature=0)
        results["calls"] = r.choices[0].message.tool_calls

    worker = threading.Thread(target=good)
    worker.start()
    chat = {"model": model, "messages": ASK, "max_tokens": 4}
    bad = [
        ({**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
         "response_format"),
        ({**chat, "structured_outputs": {"json": {"type": "string", "pattern": "a+", "maxLength": 2}}},
         "structured_outputs"),
        ({**chat, "guided_regex": "(["}, "guided_regex"),
        ({**chat, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({**chat, "logit_bias": {"99999999": 1}}, "logit_bias"),
        ({**chat, "logit_bias": {"5": -101}}, "logit_bias"),
    ]
    for body, field in bad:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30,
                       headers={"Authorization": f"Bearer {API_KEY}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    worker.join(120)
    assert results["stream"] > 0 and results["calls"]
    for call in results["calls"]:
        _check(call)
    deadline = time.monotonic() + 30
    while metric(get_metrics(server), "pagewise:num_used_kv_blocks") != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(get_metrics(server), "pagewise:num_used_kv_blocks") == 0
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
