"""A field the server knows by another name than the engine's is reported, in `param` and at the
start of the message, under the name the client sent: each spelling the API accepts for it."""

from __future__ import annotations

import re

import httpx
import pytest

MSG = [{"role": "user", "content": "hi"}]
LONG = "hello " * 5000  # more tokens than the tiny model's context window
BAD_SCHEMA = {"type": 3}  # a JSON schema no compiler accepts
TOOL = {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}

# (route, body, the field the client sent); the engine's name for it is in the comment of each group.
CASES = [
    # max_tokens
    ("chat", {"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ("chat", {"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"messages": MSG, "max_tokens": 10**9}, "max_tokens"),
    ("chat", {"messages": MSG, "max_completion_tokens": 10**9}, "max_completion_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    # logprobs
    ("chat", {"messages": MSG, "logprobs": True, "top_logprobs": 10**6}, "top_logprobs"),
    ("completions", {"prompt": "hi", "logprobs": 10**6}, "logprobs"),
    # prompt
    ("chat", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 1}, "messages"),
    ("completions", {"prompt": LONG, "max_tokens": 1}, "prompt"),
    ("completions", {"prompt": [10**8], "max_tokens": 1}, "prompt"),
    ("embeddings", {"input": [10**8]}, "input"),
    ("embeddings", {"input": LONG}, "input"),
    # structured_outputs
    *[(route, {**base, **body}, field)
      for route, base in (("chat", {"messages": MSG}), ("completions", {"prompt": "hi"}))
      for body, field in [
          ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
           "response_format"),
          ({"guided_json": BAD_SCHEMA}, "guided_json"),
          ({"guided_regex": "(["}, "guided_regex"),
          ({"guided_choice": ["a"] * 3000}, "guided_choice"),
          ({"guided_grammar": "root ::= ("}, "guided_grammar"),
          ({"structured_outputs": {"regex": "(["}}, "structured_outputs"),
          ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
      ]],
    ("chat", {"messages": MSG, "tools": [TOOL], "tool_choice": "required"}, "tools"),
    ("chat", {"messages": MSG, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools"),
]
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}


@pytest.mark.parametrize("route, body, sent", CASES, ids=[f"{r}-{'+'.join(b)}" for r, b, _ in CASES])
def test_error_names_the_field_as_sent(server, auth, route, body, sent):
    r = httpx.post(server.url + PATHS[route], json=body, headers=auth, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "invalid_request_error", r.text
    # Past the context window the message is OpenAI's own sentence, which names the field inside it.
    named = re.search(rf"\b{sent}\b", error["message"]) if error["code"] == "context_length_exceeded" else None
    assert error["param"] == sent and (error["message"].startswith(sent) or named), error


def test_serving_after_the_renamed_errors(server, auth):
    assert httpx.get(server.url + "/health").status_code == 200
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth, timeout=60,
                   json={"messages": MSG, "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
