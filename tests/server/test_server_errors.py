"""Bad input, table-driven: each case gets the right HTTP status and an OpenAI-shaped error that
names the field; the server answers normally afterwards."""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
import openai
import pytest

from tests.server.server_harness import API_KEY, MAX_BODY_BYTES, get_metrics, metric

KEY = {"Authorization": f"Bearer {API_KEY}"}
KEYJ = {**KEY, "Content-Type": "application/json"}  # for raw `content=` bodies
MSG = [{"role": "user", "content": "hi"}]
# What a Python exception's text, or pydantic's names for our classes, look like in a message.
PYTHON_TEXT = re.compile(r"Traceback|invalid literal|has no attribute|object is not|NoneType|instance of|[a-z]Error\b|"
                         r"\bdict\b|\bstr\b|\bint\b")
TOOL = {"type": "function", "function": {"name": "f"}}


def chat(**fields):
    return {"json": {"messages": MSG, "max_tokens": 4, **fields}}


def comp(**fields):
    return {"json": {"prompt": "hello", "max_tokens": 4, **fields}}


def _chunks(data: bytes, size: int = 8192):
    for i in range(0, len(data), size):
        yield data[i:i + size]


BIG = json.dumps({"prompt": "x " * MAX_BODY_BYTES, "max_tokens": 1}).encode()

# (case id, path, request kwargs, expected status, expected `param` (None: not checked), headers)
CASES = [
    ("malformed-json", "/v1/completions", {"content": b'{"prompt": "hi",'}, 400, None, KEYJ),
    ("empty-body", "/v1/chat/completions", {"content": b""}, 400, None, KEYJ),
    ("body-not-object", "/v1/completions", {"content": b"[1, 2, 3]"}, 400, None, KEYJ),
    ("text-plain-body", "/v1/completions", {"content": b'{"prompt": "hi"}'}, 415, None,
     {**KEY, "Content-Type": "text/plain"}),
    ("no-content-type", "/v1/chat/completions", {"content": b'{"messages": []}'}, 415, None, KEY),
    ("form-body", "/v1/completions", {"data": {"prompt": "hi"}}, 415, None, KEY),
    ("gzip-body", "/v1/completions", {"content": b'{"prompt": "hi"}'}, 415, None, {**KEYJ, "Content-Encoding": "gzip"}),
    ("utf16-charset", "/v1/completions", {"content": '{"prompt": "hi"}'.encode("utf-16")}, 415, None,
     {**KEY, "Content-Type": "application/json; charset=utf-16"}),
    ("post-to-a-get-route", "/health", {}, 405, None, KEY),  # no body: the route's 405, not the body's 415
    # The bad-input probe's five requests that each stopped the engine for everyone.
    ("seed-2**64", "/v1/completions", comp(seed=2**64), 400, "seed", KEY),
    ("seed-2**64-1-n2", "/v1/chat/completions", chat(seed=2**64 - 1, n=2), 400, "seed", KEY),
    ("seed-below-int64", "/v1/chat/completions", chat(seed=-2**63 - 1), 400, "seed", KEY),
    ("stop-token-id-out-of-vocab", "/v1/chat/completions", chat(stop_token_ids=[1000000], min_tokens=2), 400,
     "stop_token_ids", KEY),
    ("stop-token-id-2**70", "/v1/completions", comp(stop_token_ids=[2**70], min_tokens=1), 400, "stop_token_ids",
     KEY),
    ("repetition-penalty-tiny", "/v1/completions", comp(repetition_penalty=1e-300), 400, "repetition_penalty", KEY),
    ("max-tokens-fraction", "/v1/completions", comp(max_tokens=1.5), 400, "max_tokens", KEY),
    ("too-many-sequences", "/v1/completions", comp(prompt=["hi"] * 2000, n=128), 400, "prompt", KEY),
    ("max-tokens-string", "/v1/completions", comp(max_tokens="5"), 400, "max_tokens", KEY),
    ("temperature-string", "/v1/chat/completions", chat(temperature="hot"), 400, "temperature", KEY),
    ("n-bool", "/v1/completions", comp(n=True), 400, "n", KEY),
    ("prompt-wrong-type", "/v1/completions", comp(prompt={"text": "hi"}), 400, "prompt", KEY),
    ("unknown-model", "/v1/chat/completions", chat(model="gpt-9"), 404, "model", KEY),
    ("negative-max-tokens", "/v1/completions", comp(max_tokens=-5), 400, "max_tokens", KEY),
    ("zero-max-completion-tokens", "/v1/chat/completions", chat(max_completion_tokens=0), 400,
     "max_completion_tokens", KEY),
    ("huge-max-tokens", "/v1/completions", comp(max_tokens=10**9), 400, "max_tokens", KEY),
    ("temperature-out-of-range", "/v1/completions", comp(temperature=3.5), 400, "temperature", KEY),
    ("top-p-zero", "/v1/chat/completions", chat(top_p=0.0), 400, "top_p", KEY),
    ("n-zero", "/v1/chat/completions", chat(n=0), 400, "n", KEY),
    ("min-tokens-over-max", "/v1/completions", comp(min_tokens=10), 400, "min_tokens", KEY),
    ("completion-logprobs-too-many", "/v1/completions", comp(logprobs=50), 400, "logprobs", KEY),
    ("top-logprobs-too-many", "/v1/chat/completions", chat(logprobs=True, top_logprobs=50), 400, "top_logprobs", KEY),
    ("top-logprobs-without-logprobs", "/v1/chat/completions", chat(top_logprobs=2), 400, "top_logprobs", KEY),
    ("empty-messages", "/v1/chat/completions", {"json": {"messages": []}}, 400, "messages", KEY),
    ("messages-not-list", "/v1/chat/completions", {"json": {"messages": "hi"}}, 400, "messages", KEY),
    ("missing-messages", "/v1/chat/completions", {"json": {"max_tokens": 3}}, 400, "messages", KEY),
    ("unknown-role", "/v1/chat/completions", {"json": {"messages": [{"role": "wizard", "content": "x"}]}}, 400,
     "messages[0].role", KEY),
    ("missing-content", "/v1/chat/completions", {"json": {"messages": [{"role": "user"}]}}, 400,
     "messages[0].content", KEY),
    ("image-part", "/v1/chat/completions",
     {"json": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}}, 400,
     "messages[0].content[0]", KEY),
    ("tools-malformed", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {}}]), 400,
     "tools[0].function.name",
     KEY),
    ("tool-choice-without-tools", "/v1/chat/completions", chat(tool_choice="auto"), 400, "tool_choice", KEY),
    ("tool-choice-unknown-function", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice", KEY),
    ("tool-choice-and-response-format", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
          response_format={"type": "json_object"}), 400, "tool_choice", KEY),
    ("tool-turn-without-call-id", "/v1/chat/completions",
     {"json": {"messages": [{"role": "tool", "content": "42"}]}}, 400, "messages[0]", KEY),
    # Was a 500 (a string where the call's function object goes), and closed the connection after it.
    ("assistant-tool-call-function-not-an-object", "/v1/chat/completions",
     {"json": {"messages": [*MSG, {"role": "assistant", "tool_calls": [{"function": "x"}]}]}}, 400,
     "messages[1].tool_calls[0].function", KEY),
    ("tokenize-tool-call-function-a-list", "/tokenize",
     {"json": {"messages": [*MSG, {"role": "assistant", "tool_calls": [{"function": ["a", "b"]}]}]}}, 400,
     "messages[1].tool_calls[0].function", KEY),
    ("assistant-tool-call-name-not-a-string", "/v1/chat/completions",
     {"json": {"messages": [*MSG, {"role": "assistant", "tool_calls": [
         {"function": {"name": 1, "arguments": "{}"}}]}]}}, 400, "messages[1].tool_calls[0].function.name", KEY),
    ("assistant-tool-call-without-a-function", "/v1/chat/completions",
     {"json": {"messages": [*MSG, {"role": "assistant", "tool_calls": [{"id": "c1"}]}]}}, 400,
     "messages[1].tool_calls[0].function", KEY),
    ("functions-deprecated", "/v1/chat/completions", chat(functions=[{"name": "f"}]), 400, "functions", KEY),
    ("response-format-unknown-type", "/v1/chat/completions", chat(response_format={"type": "xml"}), 400,
     "response_format.type", KEY),
    ("response-format-schema-missing", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400,
     "response_format.json_schema.schema", KEY),
    ("response-format-bad-schema", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     400, "response_format", KEY),
    ("allowed-token-ids-empty", "/v1/completions", comp(allowed_token_ids=[]), 400, "allowed_token_ids", KEY),
    ("allowed-token-ids-outside-the-vocabulary", "/v1/completions", comp(allowed_token_ids=[10**7]), 400,
     "allowed_token_ids", KEY),
    ("bad-words-blank", "/v1/completions", comp(bad_words=[" "]), 400, "bad_words", KEY),
    ("continue-and-open-a-reply", "/v1/chat/completions", chat(continue_final_message=True), 400,
     "continue_final_message", KEY),
    ("template-kwargs-set-by-the-server", "/v1/chat/completions", chat(chat_template_kwargs={"tokenize": True}), 400,
     "chat_template_kwargs", KEY),
    ("template-kwargs-not-an-object", "/v1/chat/completions", chat(chat_template_kwargs=["x"]), 400,
     "chat_template_kwargs", KEY),
    ("response-format-schema-admits-nothing", "/v1/chat/completions",  # was a 500: no token was ever allowed
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}),
     400, "response_format", KEY),
    # Were 500s: a grammar that dead-ends after its first tokens, or whose every next token another
    # parameter bans, broke the grammar with token 0 (the argmax of a row of -inf) in the runner.
    ("grammar-dead-end-after-its-first-tokens", "/v1/completions",
     comp(max_tokens=8, structured_outputs={"grammar": 'root ::= "ab" rest\nrest ::= rest'}), 400,
     "structured_outputs", KEY),
    ("allowed-token-ids-against-a-grammar", "/v1/completions",
     comp(allowed_token_ids=[5, 6], guided_choice=["yes", "no"]), 400, "allowed_token_ids", KEY),
    ("structured-outputs-bad-regex", "/v1/completions", comp(structured_outputs={"regex": "([a-"}), 400,
     "structured_outputs", KEY),
    ("structured-outputs-unknown-key", "/v1/completions", comp(structured_outputs={"xml": "x"}), 400,
     "structured_outputs.xml", KEY),
    ("guided-choice-empty", "/v1/completions", comp(guided_choice=[]), 400, "guided_choice", KEY),
    ("two-constraints", "/v1/chat/completions",
     chat(response_format={"type": "json_object"}, guided_regex="a+"), 400, "guided_regex", KEY),
    ("logit-bias-over-100", "/v1/completions", comp(logit_bias={"5": 100.5}), 400, "logit_bias", KEY),
    ("logit-bias-out-of-vocab", "/v1/completions", comp(logit_bias={"1000000": 5}), 400, "logit_bias", KEY),
    ("logit-bias-key-not-an-id", "/v1/chat/completions", chat(logit_bias={"hello": 5}), 400, "logit_bias", KEY),
    ("unknown-field", "/v1/completions", comp(frobnicate=1), 400, "frobnicate", KEY),
    ("stream-options-without-stream", "/v1/completions", comp(stream_options={"include_usage": True}), 400,
     "stream_options", KEY),
    ("empty-prompt", "/v1/completions", comp(prompt=""), 400, "prompt", KEY),
    ("empty-prompt-list", "/v1/completions", comp(prompt=[]), 400, "prompt", KEY),
    ("token-id-out-of-vocab", "/v1/completions", comp(prompt=[1, 2, 10**7]), 400, "prompt", KEY),
    ("prompt-over-context", "/v1/completions", comp(prompt="hello " * 600), 400, "prompt", KEY),
    ("chat-over-context", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "hi " * 600}]}},
     400, "messages", KEY),
    ("oversized-body", "/v1/completions", {"content": BIG}, 413, None, KEYJ),
    ("oversized-body-chunked", "/v1/completions", {"content": _chunks}, 413, None, KEYJ),
    ("missing-api-key", "/v1/completions", comp(), 401, None, {}),
    ("wrong-api-key", "/v1/chat/completions", chat(), 401, None, {"Authorization": "Bearer nope"}),
    ("wrong-auth-scheme", "/v1/models", {}, 401, None, {"Authorization": f"Basic {API_KEY}"}),
    ("unknown-route", "/v1/rerank", comp(), 404, None, KEY),
    ("embeddings-empty-input", "/v1/embeddings", {"json": {"input": ""}}, 400, "input", KEY),
    ("embeddings-bad-input-shape", "/v1/embeddings", {"json": {"input": [1, "a"]}}, 400, "input", KEY),
    ("embeddings-dimensions", "/v1/embeddings", {"json": {"input": "a", "dimensions": 8}}, 400, "dimensions", KEY),
    ("embeddings-input-out-of-vocab", "/v1/embeddings", {"json": {"input": [1, 10**7]}}, 400, "input", KEY),
    ("embeddings-over-context", "/v1/embeddings", {"json": {"input": "hello " * 600}}, 400, "input", KEY),
    ("embeddings-bad-pooling", "/v1/embeddings", {"json": {"input": "a", "pooling": "max"}}, 400, "pooling", KEY),
    ("tokenize-neither", "/tokenize", {"json": {}}, 400, "messages", KEY),
    ("tokenize-both", "/tokenize", {"json": {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}}, 400,
     "messages", KEY),
    ("tokenize-template-options-with-a-prompt", "/tokenize",
     {"json": {"prompt": "a", "continue_final_message": True, "add_generation_prompt": False}}, 400, None, KEY),
    ("tokenize-without-key", "/tokenize", {"json": {"prompt": "a"}}, 401, None, {}),
    ("detokenize-out-of-vocab", "/detokenize", {"json": {"tokens": [1, 10**6]}}, 400, "tokens", KEY),
    ("detokenize-negative", "/detokenize", {"json": {"tokens": [-1]}}, 400, "tokens[0]", KEY),
    ("wrong-method", "/v1/completions", {"method": "GET"}, 405, None, KEY),
    # Decimal digits that are not ASCII: str.isdecimal takes them, int() did not (a 400 naming "invalid").
    ("logit-bias-key-superscript", "/v1/completions", comp(logit_bias={"\u00b2": 1}), 400, "logit_bias", KEY),
    ("logit-bias-key-circled", "/v1/chat/completions", chat(logit_bias={"\u2460": 1}), 400, "logit_bias", KEY),
    *[(f"shape-{name}", "/v1/chat/completions", chat(**fields), 400, param, KEY) for name, fields, param in [
        # Were 500s: the tool-call planner read these shapes as it found them.
        ("tool-choice-function-a-string", {"tools": [TOOL], "tool_choice": {"type": "function", "function": "f"}},
         "tool_choice.function"),
        ("tool-choice-name-a-list", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {
            "name": ["f"]}}}, "tool_choice.function.name"),
        ("tool-choice-name-an-object", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {
            "name": {"x": 1}}}}, "tool_choice.function.name"),
        ("tool-choice-a-number", {"tools": [TOOL], "tool_choice": 3}, "tool_choice"),
        ("tool-choice-unknown-word", {"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ("tool-choice-type-not-function", {"tools": [TOOL], "tool_choice": {"type": "tool", "function": {
            "name": "f"}}}, "tool_choice.type"),
        ("tools-not-a-list", {"tools": {"type": "function"}}, "tools"),
        ("tool-a-string", {"tools": ["f"]}, "tools[0]"),
        ("tool-function-a-list", {"tools": [{"type": "function", "function": ["f"]}]}, "tools[0].function"),
        ("tool-name-a-number", {"tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0].function.name"),
        ("tool-parameters-a-list", {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
         "tools[0].function.parameters"),
        ("tool-description-an-object", {"tools": [{"type": "function", "function": {"name": "f", "description": {}}}]},
         "tools[0].function.description"),
        ("tool-names-twice", {"tools": [TOOL, TOOL], "tool_choice": "required"}, "tools[1].function.name"),
        ("content-part-text-a-number", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages[0].content[0].text"),
        ("content-a-number", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ("name-a-list", {"messages": [{"role": "user", "content": "hi", "name": ["a"]}]}, "messages[0].name"),
        ("tool-call-id-a-number", {"messages": [*MSG, {"role": "tool", "content": "1", "tool_call_id": 7}]},
         "messages[1].tool_call_id"),
        ("tool-call-arguments-an-object", {"messages": [*MSG, {"role": "assistant", "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": {"x": 1}}}]}]},
         "messages[1].tool_calls[0].function.arguments"),
        ("tool-calls-not-a-list", {"messages": [*MSG, {"role": "assistant", "tool_calls": {"id": "c"}}]},
         "messages[1].tool_calls"),
        ("response-format-a-string", {"response_format": "json"}, "response_format"),
        ("json-schema-a-string", {"response_format": {"type": "json_schema", "json_schema": "x"}},
         "response_format.json_schema"),
        ("json-schema-schema-a-list", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": [1]}}}, "response_format.json_schema.schema"),
        ("json-schema-strict-a-string", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {}, "strict": "yes"}}}, "response_format.json_schema.strict"),
        ("structured-outputs-choice-a-string", {"structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
        ("structured-outputs-regex-a-list", {"structured_outputs": {"regex": ["a"]}}, "structured_outputs.regex"),
        ("guided-json-a-number", {"guided_json": 5}, "guided_json"),
        ("chat-template-kwargs-a-list", {"chat_template_kwargs": [1]}, "chat_template_kwargs"),
        ("stop-too-many", {"stop": ["a"] * 17}, "stop"),
    ]],
]


@pytest.mark.parametrize("case,path,kwargs,status,param,headers", CASES, ids=[c[0] for c in CASES])
def test_bad_input(server, case, path, kwargs, status, param, headers):
    kwargs = dict(kwargs)
    method = kwargs.pop("method", "GET" if path == "/v1/models" else "POST")
    if kwargs.get("content") is _chunks:
        kwargs["content"] = _chunks(BIG)  # a generator: sent chunked, without Content-Length
    r = httpx.request(method, server.url + path, headers=headers, timeout=30, **kwargs)
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and not PYTHON_TEXT.search(err["message"]), err
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if status == 401:
        assert r.headers.get("www-authenticate") == "Bearer"


def test_messages_say_what_to_change_and_nothing_internal(server):
    """The probe's complaints: a message that blamed valid JSON, echoed a 2,000-item list, or
    quoted xgrammar's C++ source line; /tokenize's empty messages without a param; HEAD /health."""
    def error(path, headers=KEY, **kwargs):
        r = httpx.post(server.url + path, headers=headers, timeout=30, **kwargs)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    deep = error("/v1/completions", content=b'{"prompt": "hi", "x": ' + b"[" * 300 + b"]" * 300 + b"}",
                 headers=KEYJ)
    assert "nested too deeply" in deep["message"]
    lone = error("/v1/completions", content=b'{"prompt": "h\\ud800i"}', headers=KEYJ)
    assert "surrogate pair" in lone["message"]
    assert len(error("/v1/completions", json={"prompt": "hi", "stop": ["a"] * 2000})["message"]) < 400
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": [1]}}}
    schema = error("/v1/chat/completions", json={"messages": MSG, "tools": [bad_schema], "tool_choice": "required"})
    assert "properties must be an object" in schema["message"] and ".cc:" not in schema["message"]
    assert error("/tokenize", json={"messages": []})["param"] == "messages"
    assert httpx.head(server.url + "/health").status_code == 200


def test_unparseable_http_gets_a_json_400(server):
    """uvicorn's own 400s (here a Content-Length that is not a number) in OpenAI's shape too."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: ten\r\n\r\n{}")
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), raw
    assert b"application/json" in head.lower()
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["message"]


def test_integral_floats_and_tiny_temperatures_are_served(server, auth):
    """`"max_tokens": 1.0` is the integer 1; a temperature of 1e-300 is greedy (vLLM's rule)."""
    greedy = httpx.post(server.url + "/v1/completions", headers=auth, timeout=60,
                        json={"prompt": "hello there", "max_tokens": 5, "temperature": 0, "ignore_eos": True}).json()
    tiny = httpx.post(server.url + "/v1/completions", headers=auth, timeout=60,
                      json={"prompt": "hello there", "max_tokens": 5.0, "temperature": 1e-300, "ignore_eos": True,
                            "n": 2.0, "seed": 7.0})
    assert tiny.status_code == 200, tiny.text
    choices = tiny.json()["choices"]
    assert len(choices) == 2 and tiny.json()["usage"]["completion_tokens"] == 10
    assert all(c["text"] == greedy["choices"][0]["text"] for c in choices)


def test_a_dead_end_mid_stream_is_an_error_event_naming_the_field(server, client):
    """The grammar's first tokens stream out; where it and allowed_token_ids together allow nothing
    more, the stream ends with an OpenAI-shaped error event (the official client raises it) naming
    the field. (A grammar that dead-ends on its own is refused before it runs.)"""
    model = client.models.list().data[0].id
    ab = httpx.post(server.url + "/tokenize", headers=KEY, json={"prompt": "ab", "add_special_tokens": False},
                    timeout=30).json()["tokens"]
    stream = client.completions.create(model=model, prompt="hello", max_tokens=8, temperature=0, stream=True,
                                       extra_body={"structured_outputs": {"grammar": 'root ::= "ab" "xyz"'},
                                                   "allowed_token_ids": ab})
    text = ""
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
    assert text == "ab"
    assert caught.value.body["type"] == "invalid_request_error" and caught.value.body["param"] == "allowed_token_ids"
    assert f"after {len(ab)} output tokens" in caught.value.message and "leave no token" in caught.value.message


def test_still_serving_after_bad_input(server, client):
    """Runs after the table (the same shared server): nothing above left the server broken or a KV
    block taken."""
    assert httpx.get(server.url + "/health").status_code == 200
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=MSG, max_tokens=6, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
    stream = client.completions.create(model=model, prompt="hello", max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) is not None
    # ... and no refused request holds a KV block (the engine frees finished ones on its own thread).
    deadline = time.monotonic() + 30
    while (used := metric(get_metrics(server), "pagewise:num_used_kv_blocks")) != 0:
        assert time.monotonic() < deadline, f"{used} KV blocks still in use with no request running"
        time.sleep(0.1)
    assert httpx.get(server.url + "/health").status_code == 200
