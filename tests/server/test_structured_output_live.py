"""Structured output against a live server: a grammar over a bound is a 400 naming the bound and the
field; one that refers outside itself or can never end is a 400; a large grammar compiles while
/health and other streams go on; each case is followed by /health and a normal request."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.server.server_harness import API_KEY, TINY_SERVER_ARGS, ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSG = [{"role": "user", "content": "hi"}]


def enum_schema(n: int) -> dict:
    return {"type": "object", "properties": {"v": {"enum": [f"v{i}" for i in range(n)]}}, "required": ["v"]}


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


MUTUAL = {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                    "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
          "$ref": "#/$defs/a"}

REFUSED = [
    # (what the request sends, the param, what the message names)
    ({"response_format": response_format(enum_schema(3_000))}, "response_format", "grammar_max_values"),
    ({"guided_choice": [f"c{i}" for i in range(3_000)]}, "guided_choice", "grammar_max_values"),
    ({"response_format": response_format(nested(40))}, "response_format", "grammar_max_depth"),
    ({"response_format": response_format({"$ref": "file:///etc/passwd"})}, "response_format", "refers outside"),
    ({"response_format": response_format({"type": "object", "properties": {"x": {"$ref": "http://h/s.json"}}})},
     "response_format", "refers outside"),
    ({"response_format": response_format(MUTUAL)}, "response_format", "admits no finite output"),
]


def _normal_request_works(url: str) -> None:
    assert httpx.get(url + "/health").status_code == 200
    r = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"messages": MSG, "max_tokens": 4})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("extra, param, names", REFUSED, ids=[f"{p}-{n}" for _, p, n in REFUSED])
def test_grammars_over_a_bound_or_that_cannot_end_are_400s(server, extra, param, names):
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"messages": MSG, "max_tokens": 8, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and names in error["message"], error
    assert "Traceback" not in error["message"] and ".cc:" not in error["message"]
    _normal_request_works(server.url)


def test_a_property_named_like_a_keyword_is_a_property(server):
    schema = {"type": "object", "properties": {"pattern": {"type": "string", "maxLength": 4},
                                               "maxLength": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["pattern", "maxLength"], "additionalProperties": False}
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"messages": MSG, "max_tokens": 40, "temperature": 0,
                         "response_format": response_format(schema)})
    assert r.status_code == 200, r.text
    assert set(json.loads(r.json()["choices"][0]["message"]["content"])) == {"pattern", "maxLength"}


async def _stream_gaps(http: httpx.AsyncClient, until: asyncio.Future) -> list[float]:
    """The gaps between a plain stream's chunks, stream after stream, until `until` is done."""
    body = {"prompt": "a story", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    gaps = []
    while not until.done():
        last = None
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    now = time.monotonic()
                    gaps += [now - last] if last is not None else []
                    last = now
    return gaps


async def _health_latencies(http: httpx.AsyncClient, until: asyncio.Future) -> list[float]:
    latencies = []
    while not until.done():
        start = time.monotonic()
        assert (await http.get("/health")).status_code == 200
        latencies.append(time.monotonic() - start)
        await asyncio.sleep(0.05)
    return latencies


@pytest.mark.slow  # its own server, whose bounds let a 20,000-value enum through and take their time
def test_a_large_grammar_compiles_while_health_and_streams_go_on(tiny_model_dir, tmp_path):
    """The compile (5 to 20 s for 20,000 values with this tokenizer) runs on the grammar threads:
    /health answers and running streams' chunks keep coming, no pause longer than a tenth of the
    compile (a compile on the event loop pauses both for all of it; a share, not seconds, holds on
    a loaded CPU); then the request is served, and a spec over the raised byte bound is still refused."""
    proc = ServerProcess(["--model", tiny_model_dir, "--api-key", API_KEY, *TINY_SERVER_ARGS,
                          "--grammar-max-values", "30000", "--grammar-max-bytes", "1000000",
                          "--max-body-bytes", "8388608", "--grammar-compile-timeout-s", "120"],
                         str(tmp_path / "server.log"))
    schema = {"type": "object", "properties": {"v": {"enum": [f"value-{i * 7919 % 100003:06d}-{i}"
                                                              for i in range(20_000)]}}, "required": ["v"]}
    try:
        async def main():
            async with httpx.AsyncClient(base_url=proc.url, headers=AUTH, timeout=120) as http:
                big = asyncio.get_running_loop().create_future()
                stream = asyncio.ensure_future(_stream_gaps(http, big))
                await asyncio.sleep(1.0)  # the stream is generating
                start = time.monotonic()
                request = asyncio.ensure_future(http.post("/v1/chat/completions", json={
                    "messages": MSG, "max_tokens": 30, "response_format": response_format(schema)}))
                request.add_done_callback(lambda _: big.set_result(time.monotonic() - start))
                health = await _health_latencies(http, big)
                return await stream, health, await request, big.result()

        gaps, health, answer, compile_s = asyncio.run(main())
        assert answer.status_code == 200, answer.text
        value = json.loads(answer.json()["choices"][0]["message"]["content"])["v"]
        assert value in schema["properties"]["v"]["enum"]
        assert len(gaps) > 100 and len(health) > 10
        assert max(gaps) < compile_s / 10 and max(health) < compile_s / 10, (max(gaps), max(health), compile_s)
        _normal_request_works(proc.url)
        r = httpx.post(proc.url + "/v1/completions", headers=AUTH, timeout=60,
                       json={"prompt": "hi", "max_tokens": 4, "structured_outputs": {"regex": "a" * 1_000_001}})
        assert r.status_code == 400 and "grammar_max_bytes" in r.json()["error"]["message"], r.text
        _normal_request_works(proc.url)
    finally:
        proc.stop()

