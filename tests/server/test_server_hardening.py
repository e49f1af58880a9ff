"""One request must never stop the engine: the bad-input probe's requests against a busy server,
plus the edges a browser or a load balancer sees (JSON only, CORS closed, /metrics open,
/openapi.json that documents the bodies and errors)."""

from __future__ import annotations

import asyncio

import httpx

from tests.server.server_harness import API_KEY, get_metrics, metric

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSG = [{"role": "user", "content": "hi"}]
# Each of these stopped the engine for everyone before (a 500, /health 503 until restarted).
PROBE = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "seed": 2**64}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 4, "seed": 2**64 - 1, "n": 2}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 4, "seed": -2**63 - 1}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 4, "stop_token_ids": [1000000], "min_tokens": 2}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stop_token_ids": [2**70], "min_tokens": 1}),
]
TOKENS = 48


def test_probe_requests_get_400_while_others_keep_running(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=120) as http:
            async def streamed(i):
                body = {"prompt": f"request {i} tells a story", "max_tokens": TOKENS, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    return r.status_code, (await r.aread()).decode()

            others = [asyncio.ensure_future(streamed(i)) for i in range(10)]
            await asyncio.sleep(0.3)  # the others are admitted and generating
            bad = [await http.post(path, json=body) for path, body in PROBE]
            return bad, await asyncio.gather(*others)

    bad, others = asyncio.run(main())
    for (path, body), r in zip(PROBE, bad):
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] in ("seed", "stop_token_ids"), r.text
    for status, text in others:
        assert status == 200 and text.endswith("data: [DONE]\n\n") and "error" not in text
        assert f'"completion_tokens":{TOKENS}' in text
    assert httpx.get(server.url + "/health").status_code == 200
    assert metric(get_metrics(server), "pagewise:num_used_kv_blocks") == 0


def test_metrics_are_open_by_default_while_the_api_needs_the_key(server):
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/v1/models").status_code == 401


def test_cors_is_closed_by_default(server):
    page = {"Origin": "http://evil.example"}
    preflight = httpx.options(server.url + "/v1/completions",
                              headers={**page, "Access-Control-Request-Method": "POST",
                                       "Access-Control-Request-Headers": "content-type"})
    assert "access-control-allow-origin" not in preflight.headers
    # A "simple" cross-site POST needs no preflight: it is refused before any work.
    simple = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "hi"}',
                        headers={**page, **AUTH, "Content-Type": "text/plain"})
    assert simple.status_code == 415 and "access-control-allow-origin" not in simple.headers


def test_openapi_documents_request_bodies_and_errors(server):
    spec = httpx.get(server.url + "/openapi.json", headers=AUTH).json()
    schemas = spec["components"]["schemas"]
    for path, model in [("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")]:
        op = spec["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}" and "prompt" in str(schemas[model]) or "messages" in str(
            schemas[model])
        assert {"200", "400", "401", "413", "415", "500", "503"} <= set(op["responses"])
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    assert "ChatMessage" in schemas and "ErrorResponse" in schemas
    for path, model, field in [("/tokenize", "TokenizeRequest", "messages"),
                               ("/detokenize", "DetokenizeRequest", "tokens"),
                               ("/v1/embeddings", "EmbeddingRequest", "input")]:
        op = spec["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
        assert field in schemas[model]["properties"] and {"200", "400", "401"} <= set(op["responses"])
