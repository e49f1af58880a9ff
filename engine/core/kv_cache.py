"""Paged KV cache bookkeeping: a pool of fixed-size blocks with reference counts, a free list
that doubles as the LRU of cached blocks, and prefix hashes chained block to block.

A full block is identified by hash(parent block's hash, its token ids), so two requests whose
prompts share a prefix map it to the same physical blocks. A block whose reference count
drops to zero keeps its hash and stays findable until it is reused for something else
(evicted least-recently-freed first).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from engine.request import Request


def block_hash(parent: int | None, token_ids: list[int]) -> int:
    """Chained content hash of a full block. blake2b, not hash(): a collision would silently
    serve another prompt's keys and values."""
    h = hashlib.blake2b(digest_size=16)
    h.update((parent or 0).to_bytes(16, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def chain_start(request: Request) -> int | None:
    """The hash a request's first block chains from: none for the base model, its adapter's own for
    a LoRA request, so that blocks computed through different adapters never match."""
    return None if request.lora_int_id == 0 else block_hash(None, [-1, request.lora_int_id])


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        # Blocks with ref_count 0, oldest-freed first; the first ones are evicted first.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        h = self.hash_of[block_id]
        if h is not None:  # evict: the block is about to hold other tokens
            del self.cached[h]
            self.hash_of[block_id] = None
        self.ref_count[block_id] = 1
        return block_id

    def touch(self, block_id: int) -> None:
        """Take one more reference (a prefix hit or a fork)."""
        if self.ref_count[block_id] == 0:
            del self.free[block_id]
        self.ref_count[block_id] += 1

    def release(self, block_id: int) -> None:
        assert self.ref_count[block_id] > 0, f"block {block_id} freed twice"
        self.ref_count[block_id] -= 1
        if self.ref_count[block_id] == 0:
            self.free[block_id] = None

    def set_hash(self, block_id: int, h: int) -> None:
        if self.hash_of[block_id] is None and h not in self.cached:
            self.hash_of[block_id] = h
            self.cached[h] = block_id


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks already holding this prompt's leading full blocks. At least one prompt token
        is always left to compute, because its logits are needed to sample."""
        p = request.sampling_params
        if not self.enable_prefix_caching or p.prompt_logprobs is not None or p.pooling == "mean":
            return []  # these read every prompt position's output, so every position is computed
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        blocks, parent = [], chain_start(request)
        for i in range(max_blocks):
            parent = block_hash(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            block_id = self.pool.cached.get(parent)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens (after any cached prefix). All or nothing."""
        cached_blocks = cached_blocks or []
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(request.block_ids) - len(cached_blocks)
        # Cached blocks that sit unreferenced on the free list stop being free once taken.
        reviving = sum(1 for b in cached_blocks if self.pool.ref_count[b] == 0)
        if need + reviving > self.pool.num_free:
            return False
        if cached_blocks:
            for b in cached_blocks:
                self.pool.touch(b)
            request.block_ids.extend(cached_blocks)
            n = len(cached_blocks) * self.block_size
            request.num_computed_tokens += n
            request.num_cached_tokens = n
            request.block_hashes = [self.pool.hash_of[b] for b in cached_blocks]
        for _ in range(max(need, 0)):
            request.block_ids.append(self.pool.allocate())
        return True

    def record_prefix_lookup(self, request: Request, cached_blocks: list[int]) -> None:
        self.prefix_queries += request.num_prompt_tokens
        self.prefix_hits += len(cached_blocks) * self.block_size

    def cache_full_blocks(self, request: Request) -> None:
        """Hash the blocks this request has filled completely, so later prompts can share them."""
        if not self.enable_prefix_caching:
            return
        full = request.num_computed_tokens // self.block_size
        while len(request.block_hashes) < full:
            i = len(request.block_hashes)
            parent = request.block_hashes[-1] if request.block_hashes else chain_start(request)
            h = block_hash(parent, request.token_ids_slice(i * self.block_size, (i + 1) * self.block_size))
            request.block_hashes.append(h)
            self.pool.set_hash(request.block_ids[i], h)

    def free(self, request: Request) -> None:
        # Tail blocks first, so a prompt's head outlives its tail in the LRU.
        for b in reversed(request.block_ids):
            self.pool.release(b)
        request.block_ids = []
        request.block_hashes = []

    def free_tail(self, request: Request, num_kept: int) -> None:
        """Give back the request's blocks after its first `num_kept` (they held rejected draft
        tokens only, so they were never hashed)."""
        for b in reversed(request.block_ids[num_kept:]):
            self.pool.release(b)
        del request.block_ids[num_kept:]

    def fork(self, parent: Request, child: Request, num_computed: int) -> list[tuple[int, int]] | None:
        """Give `child` the parent's blocks as they stand once `num_computed` of its tokens are
        in the cache. Full blocks are shared by reference; a partial last block is copied
        (copy-on-write up front): the (src, dst) pairs returned are for the model runner to copy.
        Returns None, changing nothing, if no block is free for the copy."""
        partial = num_computed % self.block_size != 0
        if partial and self.pool.num_free == 0:
            return None
        shared = parent.block_ids[:-1] if partial else list(parent.block_ids)
        for b in shared:
            self.pool.touch(b)
        child.block_ids = shared
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = num_computed
        if not partial:
            return []
        dst = self.pool.allocate()
        child.block_ids.append(dst)
        return [(parent.block_ids[-1], dst)]
