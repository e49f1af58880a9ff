"""Overload: with max_waiting_requests=4 (and 2 sequence slots), a burst of requests gets 503 +
Retry-After for the excess, while every admitted request completes with the right output."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server.server_harness import ServerProcess, get_metrics, metric

NUM_REQUESTS = 30
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def small_server(tiny_model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("overload") / "server.log")
    proc = ServerProcess(["--model", tiny_model_dir, "--num-kv-blocks", "512", "--num-threads", "1",
                          "--max-num-seqs", "2", "--max-waiting-requests", "4"], log)
    yield proc
    proc.stop()


def _body(i: int) -> dict:
    return {"prompt": f"Overload test {i}: tell me a story", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}


def test_excess_requests_get_503_admitted_complete(small_server):
    async def burst():
        async with httpx.AsyncClient(base_url=small_server.url, timeout=120) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=_body(i)) for i in range(NUM_REQUESTS)))

    responses = asyncio.run(burst())
    ok = {i: r for i, r in enumerate(responses) if r.status_code == 200}
    rejected = [r for r in responses if r.status_code == 503]
    assert len(ok) + len(rejected) == NUM_REQUESTS, [r.status_code for r in responses]
    assert rejected, "the burst never exceeded the waiting queue"
    assert len(ok) >= 6, "2 running + 4 waiting must all be admitted"
    for r in rejected:
        assert r.headers.get("retry-after") == "1"
        err = r.json()["error"]
        assert err["code"] == "overloaded" and err["type"] == "server_error" and "overloaded" in err["message"]

    # Admitted requests were not disturbed: same text as when each runs alone, full length.
    with httpx.Client(base_url=small_server.url, timeout=60) as http:
        for i, r in ok.items():
            alone = http.post("/v1/completions", json=_body(i)).json()
            got = r.json()
            assert got["choices"][0]["text"] == alone["choices"][0]["text"]
            assert got["usage"]["completion_tokens"] == MAX_TOKENS and got["choices"][0]["finish_reason"] == "length"

    text = get_metrics(small_server)
    assert metric(text, "pagewise:requests_rejected_total") == len(rejected)
    assert metric(text, "pagewise:num_requests_running") == 0 and metric(text, "pagewise:num_used_kv_blocks") == 0
