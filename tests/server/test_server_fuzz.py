"""Fuzz: hypothesis draws request bodies over the OpenAI schema (the fields we take, with edge
values of every JSON type and unknown fields) and sends them to the real server. No body may get
a 5xx or break a stream; afterwards the engine is healthy and holds no KV block."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.protocol import ChatCompletionRequest, CompletionRequest
from tests.server.server_harness import API_KEY, get_metrics, metric

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
EDGE_INTS = [0, 1, -1, 2, 16, 20, 21, 128, 129, 511, 512, 10**6, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
             -2**63, -2**63 - 1, 2**70, -2**70]
EDGE_FLOATS = [0.0, 1e-300, 1e-6, 0.5, 1.0, 1.0000001, 2.0, 2.5, -0.0, -1e-300, 1e300, float("inf"), float("-inf"),
               float("nan")]
scalar = st.one_of(st.none(), st.booleans(), st.sampled_from(EDGE_INTS), st.integers(),
                   st.sampled_from(EDGE_FLOATS), st.floats(), st.text(max_size=12))
anything = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                        max_leaves=8)
token_ids = st.lists(st.one_of(st.integers(0, 500), st.sampled_from(EDGE_INTS)), max_size=6)
prompt = st.one_of(*[st.text(max_size=40)] * 3, token_ids, st.lists(st.text(max_size=10), max_size=3),
                   st.lists(token_ids, max_size=3), anything)
message = st.fixed_dictionaries({"role": st.sampled_from(["user"] * 4 + ["system", "assistant", "developer", "tool"]),
                                 "content": st.one_of(*[st.text(max_size=30)] * 4, st.lists(st.fixed_dictionaries(
                                     {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}),
                                     max_size=2), anything)})


INT_FIELDS = {"n", "seed", "top_k", "min_tokens", "logprobs", "top_logprobs"}
FLOAT_FIELDS = {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"}
max_tokens = st.one_of(*[st.integers(1, 8)] * 3, st.sampled_from(EDGE_INTS + EDGE_FLOATS))
VALID = {  # values the API takes, for the base of every body
    "n": st.integers(1, 4), "seed": st.integers(-2**63, 2**63 - 1), "top_k": st.integers(-1, 600),
    "min_tokens": st.integers(0, 1), "logprobs": st.integers(0, 20), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.01, 10),
    "stop": st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, 400), max_size=4), "stream": st.booleans(), "echo": st.booleans(),
    "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
}


def edge_values(name: str):
    """A well-typed value at or across the field's edges (the requests that stopped the engine were
    well-typed but extreme), or now and then anything at all."""
    if name in INT_FIELDS:
        edge = st.sampled_from(EDGE_INTS)
    elif name in FLOAT_FIELDS:
        edge = st.sampled_from(EDGE_FLOATS)
    elif name in ("max_tokens", "max_completion_tokens"):
        edge = max_tokens
    elif name == "stop_token_ids":
        edge = token_ids
    elif name == "stop":
        edge = st.lists(st.text(max_size=5), max_size=20)
    elif name == "prompt":
        edge = prompt
    elif name == "messages":
        edge = st.lists(message, max_size=3)
    else:
        edge = st.booleans()
    return st.one_of(edge, edge, edge, anything)


def bodies(model, required: dict):
    """A valid body (the required fields and any sampling fields), then one to three fields of the
    schema, the no-op ones such as `tools` too, or unknown ones, set to an edge value: each
    body reaches the engine unless a mutated field stops it at the edge."""
    names = sorted(set(VALID) & set(model.model_fields))
    base = st.fixed_dictionaries(required, optional={k: VALID[k] for k in names})
    fields = st.one_of(*[st.sampled_from(sorted(set(model.model_fields) - {"model"}))] * 4, st.text(max_size=8))
    mutations = st.lists(fields, min_size=1, max_size=3, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({k: edge_values(k) for k in chosen}))
    return st.tuples(base, mutations).map(lambda t: {**t[0], **t[1]})


COMPLETION = {"prompt": st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 400), min_size=1,
                                                                              max_size=6)),
              "max_tokens": st.integers(1, 8)}
CHAT = {"messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=30)}),
                             min_size=1, max_size=3), "max_tokens": st.integers(1, 8)}
# The mutated `prompt` / `messages` get other shapes too.
ROUTES = st.one_of(st.tuples(st.just("/v1/completions"), bodies(CompletionRequest, COMPLETION)),
                   st.tuples(st.just("/v1/chat/completions"), bodies(ChatCompletionRequest, CHAT)))


def _send(server, route) -> None:
    path, body = route
    payload = json.dumps(body)  # NaN and Infinity are written as JSON's usual extension
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=120) as http:
        r = http.post(path, content=payload)
    assert r.status_code < 500, (body, r.status_code, r.text)
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text, (body, r.text[-500:])
    elif r.status_code != 200:
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error", (body, r.text)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(route=ROUTES)
def test_no_body_gets_a_5xx(server, route):
    _send(server, route)


EDGE_LISTS = [[10**6], [2**63], [2**64], [2**70], [-1], [512, 0]]
BASES = [("/v1/completions", {"prompt": "hello there", "max_tokens": 3}),
         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})]


def _one_edge_each():
    """Every sampling field of a valid, sampled (temperature 1) body with min_tokens 1 (so that
    stop ids are banned from the logits), set in turn to each of its edge values."""
    for path, base in BASES:
        model = CompletionRequest if path == "/v1/completions" else ChatCompletionRequest
        base = {**base, "temperature": 1.0, "min_tokens": 1}
        for name in sorted((INT_FIELDS | FLOAT_FIELDS | {"max_tokens", "stop_token_ids"}) & set(model.model_fields)):
            edges = EDGE_LISTS if name == "stop_token_ids" else EDGE_INTS + EDGE_FLOATS
            for value in edges:
                yield path, {**base, name: value, **({"logprobs": True} if name == "top_logprobs" else {})}


def test_no_single_edge_value_gets_a_5xx(server):
    """Systematic where hypothesis samples: one field at an edge, the rest valid, every pair."""
    for route in _one_edge_each():
        _send(server, route)


def test_engine_is_healthy_and_empty_after_the_fuzz(server):
    assert httpx.get(server.url + "/health").status_code == 200
    deadline = time.monotonic() + 30
    while metric(get_metrics(server), "pagewise:num_used_kv_blocks") != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(get_metrics(server), "pagewise:num_used_kv_blocks") == 0
