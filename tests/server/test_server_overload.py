"""Overload: past max_waiting_requests, a burst of requests gets 503 + Retry-After for the excess,
while every admitted request completes with the right output; whether sequence slots (2 here) or
KV cache blocks are what runs out."""

from __future__ import annotations


import httpx
import pytest

from tests.server.server_harness import ServerProcess, burst, get_metrics, metric

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
    responses = burst(small_server.url, [_body(i) for i in range(NUM_REQUESTS)])
    ok = {i: r for i, r in enumerate(responses) if r.status_code == 200}
    rejected = [r for r in responses if r.status_code == 503]
    assert rejected, "the burst never exceeded the waiting queue"
    assert len(ok) >= 6, "2 running + 4 waiting must all be admitted"
    for r in rejected:
        err = r.json()["error"]
        assert err["type"] == "server_error" and "overloaded" in err["message"]

    # Admitted requests were not disturbed: same text as when each runs alone, full length.
    with httpx.Client(base_url=small_server.url, timeout=60) as http:
        for i, r in ok.items():
            alone = http.post("/v1/completions", json=_body(i)).json()
            got = r.json()
            assert got["choices"][0]["text"] == alone["choices"][0]["text"]
            assert got["usage"]["completion_tokens"] == MAX_TOKENS and got["choices"][0]["finish_reason"] == "length"

    text = get_metrics(small_server)
    assert metric(text, "pagewise:requests_rejected_total") == len(responses) - len(ok)
    assert metric(text, "pagewise:num_requests_running") == 0 and metric(text, "pagewise:num_used_kv_blocks") == 0


# The KV cache, not --max-num-seqs (256), is the limit here: 24 blocks of 16 tokens hold about two of
# these requests at their full length (40 + 160 tokens, 13 blocks), and six prompts (3 blocks) at once.
KV_BLOCKS, KV_WAITING, KV_PROMPT, KV_MAX_TOKENS, KV_BURST = 24, 8, 40, 160, 64


@pytest.fixture(scope="module")
def kv_bound_server(tiny_model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("overload-kv") / "server.log")
    proc = ServerProcess(["--model", tiny_model_dir, "--num-kv-blocks", str(KV_BLOCKS), "--num-threads", "1",
                          "--max-waiting-requests", str(KV_WAITING)], log)
    yield proc
    proc.stop()


def _kv_body(i: int) -> dict:
    return {"prompt": [(7 * i + j) % 500 + 1 for j in range(KV_PROMPT)], "max_tokens": KV_MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}


def test_kv_cache_bound_waiting_is_bounded_too(kv_bound_server):
    """With KV blocks the limit, the waiting bound still holds: of 64 requests at once, the excess
    get 503 + Retry-After (before, all 64 queued and the last waited minutes); every admitted one
    completes in full through preemptions; then no block is in use and the server serves on."""
    responses = burst(kv_bound_server.url, [_kv_body(i) for i in range(KV_BURST)])
    ok = [r for r in responses if r.status_code == 200]
    # At most the six prompts that fit at once plus the eight that may wait, and a few more admitted
    # as the first ones finish while the burst is still arriving.
    assert KV_WAITING <= len(ok) <= 24, len(ok)
    for r in ok:
        got = r.json()
        assert got["usage"]["completion_tokens"] == KV_MAX_TOKENS and got["choices"][0]["finish_reason"] == "length"

    text = get_metrics(kv_bound_server)
    assert metric(text, "pagewise:num_preemptions_total") > 0, "the KV cache was never the limit"
    assert metric(text, "pagewise:requests_rejected_total") == len(responses) - len(ok)
    assert metric(text, "pagewise:num_requests_running") == 0 and metric(text, "pagewise:num_used_kv_blocks") == 0
    # A normal request succeeds, and an admitted one's text (recomputed after preemptions) is what
    # the same request gives alone.
    first = next(i for i, r in enumerate(responses) if r.status_code == 200)
    with httpx.Client(base_url=kv_bound_server.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json=_kv_body(first))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == responses[first].json()["choices"][0]["text"]
