"""Block accounting: random allocate / append / fork / free / abort sequences never lose or
double-free a block, and a prefix hit always maps to blocks holding exactly those tokens."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.core.kv_cache import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 24


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=True)
        self.live: list[Request] = []
        self.content: dict[int, list[int]] = {}  # shadow copy: the tokens each block holds
        self.n = 0

    def _new(self, tokens: list[int]) -> Request:
        self.n += 1
        return Request(str(self.n), tokens, SamplingParams())

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=30))
    def allocate(self, tokens):
        """A waiting request: look up its prefix, then allocate its first chunk (or fail cleanly)."""
        req = self._new(tokens)
        cached = self.kv.find_cached_prefix(req)
        for i, b in enumerate(cached):
            assert self.content[b] == tokens[i * BLOCK:(i + 1) * BLOCK], "prefix hit on a block with other tokens"
        free_before = self.kv.num_free_blocks
        chunk = min(len(tokens) - len(cached) * BLOCK, 8)
        if self.kv.allocate_slots(req, chunk, cached):
            self._compute(req, chunk)
            self.live.append(req)
        else:
            assert self.kv.num_free_blocks == free_before and req.block_ids == [], "failed allocation changed state"

    def _compute(self, req: Request, n: int) -> None:
        """What the model runner does: write n tokens' KV into their slots, then hash full blocks."""
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            b = req.block_ids[pos // BLOCK]
            slot = pos % BLOCK
            self.content[b] = self.content.get(b, [])[:slot] + [req.all_token_ids[pos]]
        req.num_computed_tokens += n
        self.kv.cache_full_blocks(req)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100), new=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def append(self, i, new):
        """Continue a prefill or decode: more tokens for a running request."""
        req = self.live[i % len(self.live)]
        if req.num_computed_tokens < req.num_tokens:
            n = req.num_tokens - req.num_computed_tokens
        else:
            req.output_token_ids.extend(new)
            n = len(new)
        if self.kv.allocate_slots(req, n):
            self._compute(req, n)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def fork(self, i):
        parent = self.live[i % len(self.live)]
        if parent.num_computed_tokens < parent.num_tokens:
            return
        child = self._new(parent.prompt_token_ids)
        child.output_token_ids = list(parent.output_token_ids)
        copies = self.kv.fork(parent, child, parent.num_computed_tokens)
        if copies is None:
            return
        for src, dst in copies:
            self.content[dst] = list(self.content[src])
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        """Finish or abort: both hand every block back."""
        self.kv.free(self.live.pop(i % len(self.live)))

    @invariant()
    def blocks_accounted(self):
        pool = self.kv.pool
        refs = Counter(b for r in self.live for b in r.block_ids)
        for b in range(NUM_BLOCKS):
            assert pool.ref_count[b] == refs[b], f"block {b}: ref count {pool.ref_count[b]}, held {refs[b]} times"
        assert set(pool.free) == {b for b in range(NUM_BLOCKS) if refs[b] == 0}, "free list != unreferenced blocks"
        for h, b in pool.cached.items():
            assert pool.hash_of[b] == h
        for r in self.live:
            assert len(r.block_ids) == -(-r.num_computed_tokens // BLOCK) or r.num_computed_tokens < r.num_tokens

    def teardown(self):
        for r in self.live:
            self.kv.free(r)
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert all(c == 0 for c in self.kv.pool.ref_count)


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheBlockAccounting = KVCacheMachine.TestCase


def test_eviction_is_least_recently_freed():
    kv = KVCacheManager(4, BLOCK)
    a = Request("a", list(range(8)) + [9], SamplingParams())  # two full blocks and a partial one
    assert kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    kv.cache_full_blocks(a)
    head, second = a.block_ids[:2]
    kv.free(a)  # tail first onto the LRU, so the prompt's head is evicted last
    b = Request("b", list(range(8)) + [7], SamplingParams())
    assert kv.find_cached_prefix(b) == [head, second]
    c = Request("c", [50] * 12, SamplingParams())
    assert kv.allocate_slots(c, 12)  # 3 blocks: the never-used one, a's partial tail, then `second`
    assert kv.find_cached_prefix(b) == [head], "the head block outlives the blocks after it"
