"""Scheduler, unit by unit, on a real KVCacheManager: the token budget, decode first, chunked
prefill, the CPU prefill budgets, the sequence budget (n counts), preemption order, and aborts
(which cost O(1) each and end a prefill between its chunks)."""

from __future__ import annotations

from collections import deque

from engine.config import EngineConfig
from engine.core.kv_cache import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

BLOCK = 4


def make(num_blocks=64, cpu=False, **config) -> Scheduler:
    cfg = EngineConfig(block_size=8, **config)  # block_size here is the config's; the manager's is BLOCK
    return Scheduler(cfg, KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=False), max_model_len=1024,
                     cpu=cpu)


def req(rid: str, prompt_len: int, n: int = 1) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(n=n, max_tokens=100))


def run(s: Scheduler) -> list[tuple[Request, int]]:
    """One step as the core does it: schedule, mark the tokens computed, and add one output token
    to every request whose prompt is done. Returns what the step ran."""
    s.schedule()
    scheduled = list(s.scheduled)
    s.update_computed()
    for r, n in scheduled:
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(7)
    return scheduled


def test_token_budget_and_chunked_prefill():
    s = make(max_num_batched_tokens=10)
    a, b = req("a", 6), req("b", 9)
    s.add(a)
    s.add(b)
    out = run(s)
    assert [(r.request_id, n) for r, n in out] == [("a", 6), ("b", 4)]  # b is chunked
    assert s.num_chunked_prefills == 1
    out = run(s)  # a decodes first (1 token), then b's prefill goes on with what is left
    assert [(r.request_id, n) for r, n in out] == [("a", 1), ("b", 5)]


def test_without_chunking_a_prompt_waits_for_a_budget_that_holds_it():
    s = make(max_num_batched_tokens=10, enable_chunked_prefill=False)
    s.add(req("a", 6))
    s.add(req("b", 9))
    assert [r.request_id for r, _ in run(s)] == ["a"]
    assert [r.request_id for r, _ in run(s)] == ["a", "b"]


def _pairs(start: int, n: int) -> int:
    """(query, key) pairs of a causal chunk: its token at position p attends to p + 1 keys."""
    return sum(p + 1 for p in range(start, start + n))


def test_cpu_prefill_budgets_hold_every_step_and_decodes_go_on():
    s = make(cpu=True, max_num_batched_tokens=64, cpu_max_prefill_tokens=10, cpu_max_prefill_attention=100)
    a, b = req("a", 3), req("b", 60)
    s.add(a)
    run(s)  # a's prompt: 3 tokens, 6 pairs
    s.add(b)
    chunks = []
    while b.num_computed_tokens < 60:
        out = dict((r.request_id, n) for r, n in run(s))
        assert out.get("a") == 1  # a decode is never held back by the prefill budgets
        start = b.num_computed_tokens - out["b"]
        chunks.append(out["b"])
        # within both budgets, or the one token that keeps a prefill going where no token fits
        assert out["b"] <= 10 and (_pairs(start, out["b"]) <= 100 or out["b"] == 1)
        assert out["b"] == 1 or _pairs(start, out["b"] + 1) > 100 or out["b"] == 10  # the largest that fits
    assert chunks[:3] == [10, 7, 5] and chunks[-1] == 1 and sum(chunks) == 60


def test_prefill_budgets_apply_on_cpu_with_chunking_only():
    for s in (make(max_num_batched_tokens=64, cpu_max_prefill_tokens=10),
              make(cpu=True, enable_chunked_prefill=False, max_num_batched_tokens=64, cpu_max_prefill_tokens=10)):
        s.add(req("b", 60))
        assert [n for _, n in run(s)] == [60]


def test_an_aborted_prefill_gets_no_more_chunks():
    s = make(max_num_batched_tokens=8)
    a, b = req("a", 30), req("b", 4)
    s.add(a)
    s.add(b)
    assert [(r.request_id, n) for r, n in run(s)] == [("a", 8)]
    s.finish(a)  # the client went away between two chunks
    assert [(r.request_id, n) for r, n in run(s)] == [("b", 4)]
    assert a.num_computed_tokens == 8 and a not in s.running and s.kv.num_free_blocks == 64 - 1  # b's one block


def test_sequence_budget_counts_every_choice():
    s = make(max_num_seqs=4)
    s.add(req("a", 3, n=3))
    s.add(req("b", 3, n=2))  # 3 + 2 > 4: waits even though one slot is free
    assert [r.request_id for r, _ in run(s)] == ["a"]
    assert s.num_waiting == 1 and s.num_waiting_seqs == 2


def test_preemption_takes_the_newest_and_requeues_it_first():
    s = make(num_blocks=4, max_num_batched_tokens=64)
    a, b = req("a", 8), req("b", 7)  # 2 blocks each: the pool is full after prefill
    s.add(a)
    s.add(b)
    run(s)
    out = run(s)  # a's 9th token needs a third block: b (newest) is preempted
    assert [r.request_id for r, _ in out] == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert s.num_preemptions == 1


def test_step_output_sends_each_stream_once_then_only_what_changed():
    """The runner's copy of every stream, rebuilt from the plain outputs alone (as a follower
    process does), matches the scheduler's Requests step after step: new streams whole, then
    new tokens and blocks; forks with their block copy; finished streams named; a preempted
    stream's blocks replaced when it comes back."""
    s = make(num_blocks=6, max_num_batched_tokens=64)
    a, b = req("a", 6), req("b", 5, n=2)
    s.add(a)
    s.add(b)
    held = {}  # what a runner holds: key -> [tokens, blocks, num_computed]

    def step(token: int):
        """One step; every stream that reached its end (a fork too) gets `token`."""
        out = s.schedule()
        for key in out.finished_req_ids:
            held.pop(key)
        for new in out.new_reqs + [child for _, child in out.forks]:
            held[new.req_id] = [new.prompt_token_ids + new.output_token_ids, list(new.block_ids),
                                new.num_computed_tokens]
        for c in out.cached_reqs:
            h = held[c.req_id]
            h[0] = h[0] + c.new_token_ids
            h[1] = list(c.new_block_ids) if c.resumed else h[1] + c.new_block_ids
            h[2] = c.num_computed_tokens
        streams = dict(s.step_streams)
        for key, n in out.num_scheduled_tokens:
            r = streams[key]
            assert held[key] == [r.all_token_ids, r.block_ids, r.num_computed_tokens], key
        s.update_computed()
        for r in streams.values():
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(token)
        return out

    out = step(10)
    assert [n.req_id for n in out.new_reqs] == ["a#0", "b#0"] and not out.cached_reqs
    # b's prompt completes: its second choice shares the full block and gets a copy of the partial one.
    assert [(parent, child.req_id) for parent, child in out.forks] == [("b#0", "b#1")]
    (child,) = [c for _, c in out.forks]
    assert child.block_ids[0] == b.block_ids[0] and out.block_copies == [(b.block_ids[1], child.block_ids[1])]
    out = step(11)
    assert not out.new_reqs and [(c.req_id, c.new_token_ids) for c in out.cached_reqs] == [
        ("a#0", [10]), ("b#0", [10]), ("b#1", [10])]
    s.finish(a)
    out = step(12)
    assert out.finished_req_ids == ["a#0"] and "a#0" not in {k for k, _ in out.num_scheduled_tokens}
    # Fill the pool until a choice is preempted, then let it come back.
    while s.num_preemptions == 0:
        out = step(13)
    victim = s.waiting[0]
    for r in list(s.running):
        s.finish(r)
    out = step(14)
    (resumed,) = out.cached_reqs
    assert resumed.req_id == victim.key and resumed.resumed and resumed.new_block_ids == victim.block_ids
    assert sorted(out.finished_req_ids) == sorted({"b#0", "b#1"} - {victim.key})


def test_aborting_waiting_requests_skips_them_and_keeps_counts():
    s = make(max_num_seqs=1)
    reqs = [req(str(i), 3, n=2 if i % 2 else 1) for i in range(6)]
    for r in reqs:
        s.add(r)
    for r in reqs[:4]:
        s.finish(r)
    assert s.num_waiting == 2 and s.num_waiting_seqs == 1 + 2
    assert [r.request_id for r, _ in run(s)] == ["4"]
    assert s.num_waiting == 1 and s.kv.num_free_blocks == 64 - 1


class _Visits:
    """Counts the queued requests an abort looks at: each comparison (a list or deque scan,
    `in`, remove, index) and each request iterated out of the waiting queue."""

    count = 0


class _CountingRequest(Request):
    __hash__ = Request.__hash__

    def __eq__(self, other):
        _Visits.count += 1
        return self is other


class _CountingQueue(deque):
    def __iter__(self):
        for r in super().__iter__():
            _Visits.count += 1
            yield r

    def __reversed__(self):
        for r in super().__reversed__():
            _Visits.count += 1
            yield r

    def __getitem__(self, i):
        _Visits.count += 1
        return super().__getitem__(i)


def test_aborting_n_queued_requests_is_linear():
    """The probe measured 0.57 / 1.62 / 4.70 s to cancel 500 / 1,000 / 2,000 queued requests: each
    abort scanned the queue. Counted instead of timed: aborting 2,000 queued requests, each from the
    far end of the queue (a scan's worst order), looks at a few requests each, not a thousand."""
    num = 2_000
    s = make()
    s.waiting = _CountingQueue(s.waiting)
    reqs = [_CountingRequest(str(i), [1, 2, 3], SamplingParams(max_tokens=100)) for i in range(num)]
    for r in reqs:
        s.add(r)
    _Visits.count = 0
    for r in reversed(reqs):
        s.finish(r)
    assert s.num_waiting == 0
    assert _Visits.count <= 2 * num, _Visits.count  # a scan each: about num * num / 2 = 2,000,000


def test_prefill_limits_are_for_serving_unless_set():
    """Offline (a config left unset) a CPU step prefills its whole token budget; an online engine
    (AsyncEngine) fills in the serving limits; one limit set alone leaves the other unlimited."""
    from engine.config import SERVING_CPU_MAX_PREFILL_TOKENS, EngineConfig
    from engine.core.kv_cache import KVCacheManager
    from engine.core.scheduler import Scheduler

    def budgets(config):
        s = Scheduler(config, KVCacheManager(64, 16, True), 1024, cpu=True)
        return s.prefill_token_budget, s.prefill_attention_budget

    assert budgets(EngineConfig()) == (None, None)
    tokens, pairs = budgets(EngineConfig().for_serving())
    assert tokens == SERVING_CPU_MAX_PREFILL_TOKENS and pairs is not None
    tokens, pairs = budgets(EngineConfig(cpu_max_prefill_tokens=64))
    assert tokens == 64 and pairs > 1 << 40
