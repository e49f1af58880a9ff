"""Admission behind `--data-parallel-size 2`: requests sent to a replica that has not reported them
yet count as waiting (the front's stats, which admission reads), and over a live server the
waiting bound holds when each replica's KV cache is the limit: the excess get 503 + Retry-After,
every admitted request completes, and no block stays in use."""

from __future__ import annotations

import httpx
import pytest

from engine.config import EngineConfig
from engine.frontend.data_parallel import DataParallelCore
from engine.sampling_params import SamplingParams
from tests.server.server_harness import ServerProcess, burst, get_metrics, metric

WAITING, PROMPT, MAX_TOKENS, BURST = 8, 40, 120, 64


@pytest.fixture(scope="module")
def server(gqa_model, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("dp-admission") / "server.log")
    # 20 blocks of 16 tokens a replica: about two of these requests at full length each.
    proc = ServerProcess(["--model", gqa_model, "--data-parallel-size", "2", "--num-kv-blocks", "20",
                          "--num-threads", "1", "--max-waiting-requests", str(WAITING)], log)
    yield proc
    proc.stop()


def _body(i: int) -> dict:
    return {"prompt": [(7 * i + j) % 500 + 1 for j in range(PROMPT)], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}


def test_requests_not_yet_reported_by_a_replica_count_as_waiting(gqa_model):
    core = DataParallelCore(EngineConfig(model=gqa_model, data_parallel_size=2, num_kv_blocks=20, num_threads=1,
                                         device="cpu"))
    try:
        for i in range(5):
            core.add_request(f"r{i}", _body(i)["prompt"], SamplingParams(max_tokens=4, n=3 if i == 0 else 1))
        sent = core.stats()  # no replica has reported since: all five are on their way
        while core.has_unfinished_requests():
            core.step()
        done = core.stats()
    finally:
        core.shutdown()
    assert (sent["num_waiting"], sent["num_waiting_seqs"], sent["num_running"]) == (5, 3 + 4, 0)
    assert (done["num_waiting"], done["num_waiting_seqs"], done["num_used_blocks"]) == (0, 0, 0)
    assert done["num_requests_added"] == 5


@pytest.mark.slow
def test_waiting_bound_holds_over_replicas(server):
    ok = [r for r in burst(server.url, [_body(i) for i in range(BURST)]) if r.status_code == 200]
    # The prompts that fit both replicas at once (2 x 6) plus the eight that may wait, and a few
    # admitted as the first ones finish while the burst still arrives.
    assert WAITING <= len(ok) <= 32, len(ok)
    assert all(r.json()["usage"]["completion_tokens"] == MAX_TOKENS for r in ok)
    text = get_metrics(server)
    assert metric(text, "pagewise:num_requests_running") == 0 and metric(text, "pagewise:num_used_kv_blocks") == 0
    assert metric(text, "pagewise:num_requests_waiting") == 0
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        r = http.post("/v1/completions", json=_body(0))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS
