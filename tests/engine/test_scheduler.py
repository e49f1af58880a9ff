"""Scheduler, unit by unit, on a real KVCacheManager: the token budget, decode first, chunked
prefill, the sequence budget (n counts), preemption order, and aborts that cost O(1) each."""

from __future__ import annotations

import time

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

BLOCK = 4


def make(num_blocks=64, **config) -> Scheduler:
    cfg = EngineConfig(block_size=8, **config)  # block_size here is the config's; the manager's is BLOCK
    return Scheduler(cfg, KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=False), max_model_len=1024)


def req(rid: str, prompt_len: int, n: int = 1) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(n=n, max_tokens=100))


def run(s: Scheduler):
    """One step as the core does it: schedule, then count the tokens computed and add one output
    token to every request whose prompt is done."""
    out = s.schedule()
    for r, n in out.scheduled:
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(7)
    return out


def test_token_budget_and_chunked_prefill():
    s = make(max_num_batched_tokens=10)
    a, b = req("a", 6), req("b", 9)
    s.add(a)
    s.add(b)
    out = run(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 6), ("b", 4)]  # b is chunked
    assert s.num_chunked_prefills == 1
    out = run(s)  # a decodes first (1 token), then b's prefill goes on with what is left
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 5)]


def test_without_chunking_a_prompt_waits_for_a_budget_that_holds_it():
    s = make(max_num_batched_tokens=10, enable_chunked_prefill=False)
    s.add(req("a", 6))
    s.add(req("b", 9))
    assert [r.request_id for r, _ in run(s).scheduled] == ["a"]
    assert [r.request_id for r, _ in run(s).scheduled] == ["a", "b"]


def test_sequence_budget_counts_every_choice():
    s = make(max_num_seqs=4)
    s.add(req("a", 3, n=3))
    s.add(req("b", 3, n=2))  # 3 + 2 > 4: waits even though one slot is free
    assert [r.request_id for r, _ in run(s).scheduled] == ["a"]
    assert s.num_waiting == 1 and s.num_waiting_seqs == 2


def test_preemption_takes_the_newest_and_requeues_it_first():
    s = make(num_blocks=4, max_num_batched_tokens=64)
    a, b = req("a", 8), req("b", 7)  # 2 blocks each: the pool is full after prefill
    s.add(a)
    s.add(b)
    run(s)
    out = run(s)  # a's 9th token needs a third block: b (newest) is preempted
    assert out.preempted == [b] and [r.request_id for r, _ in out.scheduled] == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert s.num_preemptions == 1


def test_aborting_waiting_requests_skips_them_and_keeps_counts():
    s = make(max_num_seqs=1)
    reqs = [req(str(i), 3, n=2 if i % 2 else 1) for i in range(6)]
    for r in reqs:
        s.add(r)
    for r in reqs[:4]:
        s.finish(r)
    assert s.num_waiting == 2 and s.num_waiting_seqs == 1 + 2
    assert [r.request_id for r, _ in run(s).scheduled] == ["4"]
    assert s.num_waiting == 1 and s.kv.num_free_blocks == 64 - 1


def _abort_seconds(num: int) -> float:
    s = make()
    reqs = [req(str(i), 3) for i in range(num)]
    for r in reqs:
        s.add(r)
    start = time.perf_counter()
    for r in reversed(reqs):  # the worst order for a list scan: each one from the far end
        s.finish(r)
    return time.perf_counter() - start


def test_aborting_n_queued_requests_is_linear():
    """The probe measured 0.57 / 1.62 / 4.70 s to cancel 500 / 1,000 / 2,000 queued requests
    (quadratic). Four times the requests must cost about four times as long, not sixteen."""
    small = min(_abort_seconds(5_000) for _ in range(3))
    large = min(_abort_seconds(20_000) for _ in range(3))
    assert large / small < 8, (small, large)
