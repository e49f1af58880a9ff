"""Token-budget scheduler: running requests first (decodes and unfinished prefill chunks),
then waiting prompts, chunked to fit the budget; preempts the newest request when blocks run out.

It owns the KV cache manager: it allocates a request's blocks when it schedules it, hashes the
blocks a step filled, forks the prompt's blocks to an n > 1 request's other choices, and frees
a request's blocks when it is preempted or ends. Nothing else changes block ownership."""

from __future__ import annotations

from collections import deque

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler_output import SchedulerOutput


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int):
        self.max_num_seqs = config.max_num_seqs
        self.token_budget = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.max_model_len = max_model_len
        self.kv = kv
        # Finished (aborted) requests stay in the deque until they reach its head, so that an
        # abort costs O(1) however long the queue is; num_waiting counts the live ones.
        self.waiting: deque[Request] = deque()
        self.num_waiting = 0
        self.num_waiting_seqs = 0  # an unforked n > 1 request becomes n sequences when it runs
        self.running: list[Request] = []  # oldest first: the last one is preempted first
        self.num_preemptions = 0
        self.num_chunked_prefills = 0  # prefill steps that did not reach the end of the prompt
        self.num_scheduled_tokens = 0  # tokens run through the model, prefill and decode

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self._enqueue(request, front=False)

    def fork(self, first: Request, child: Request) -> list[tuple[int, int]] | None:
        """Give `child` (another choice of `first`'s request) the prompt's blocks; it decodes from
        the next step. Returns the (src, dst) block copies the runner must make (a partial last
        block is copied up front), or None when no block was free for that copy: then the child
        waits and recomputes its prompt."""
        copies = self.kv.fork(first, child)
        if copies is None:
            self.add(child)
            return None
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        return copies

    def update_computed(self, out: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens' K/V are in the cache; hash the blocks they filled."""
        for req, n in out.scheduled:
            req.num_computed_tokens += n
            self.kv.cache_full_blocks(req)

    def has_work(self) -> bool:
        return bool(self.num_waiting or self.running)

    @staticmethod
    def _seqs(req: Request) -> int:
        return 1 if req.forked else req.sampling_params.n

    def _enqueue(self, req: Request, front: bool) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(req)
        self.num_waiting += 1
        self.num_waiting_seqs += self._seqs(req)

    def _pop_waiting(self) -> None:
        req = self.waiting.popleft()
        self.num_waiting -= 1
        self.num_waiting_seqs -= self._seqs(req)

    def _drop_finished_head(self) -> None:
        while self.waiting and self.waiting[0].is_finished:
            self.waiting.popleft()  # already uncounted by finish()

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.token_budget
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            assert n > 0, f"running request {req.key} has no token to compute"
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, n))
                budget -= n
                i += 1
        if out.preempted:  # blocks are short: admit nothing new this step
            self._record_step(out)
            return out
        # An unforked parent in its prefill already holds the slots of its n choices.
        running_seqs = sum(self._seqs(r) for r in self.running)
        while budget > 0:
            self._drop_finished_head()
            if not self.waiting:
                break
            req = self.waiting[0]
            # Admission refuses n > max_num_seqs, so a request that does not fit now fits later.
            if running_seqs + self._seqs(req) > self.max_num_seqs:
                break
            cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            remaining = req.num_tokens - req.num_computed_tokens - len(cached) * self.kv.block_size
            if not self.chunked_prefill and remaining > budget:
                break
            n = min(remaining, budget)
            if not self.kv.allocate_slots(req, n, cached):
                break
            if req.status == RequestStatus.WAITING:
                self.kv.record_prefix_lookup(req, cached)
            self._pop_waiting()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            running_seqs += self._seqs(req)
            out.scheduled.append((req, n))
            budget -= n
        self._record_step(out)
        return out

    def _record_step(self, out: SchedulerOutput) -> None:
        self.num_scheduled_tokens += out.num_tokens
        self.num_chunked_prefills += sum(1 for r, n in out.scheduled if r.num_computed_tokens + n < r.num_tokens)

    def _preempt(self, req: Request) -> None:
        """Drop the request's KV and queue it first in line; it will recompute its tokens."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self._enqueue(req, front=True)
        self.num_preemptions += 1

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request wherever it is and free its blocks. O(1) for a
        waiting request (it is skipped when it reaches the head of the queue); running ones are
        at most max_num_seqs."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.num_waiting -= 1
            self.num_waiting_seqs -= self._seqs(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
