"""Token-budget scheduler: running requests first (decodes and unfinished prefill chunks),
then waiting prompts, chunked to fit the budget; preempts the newest request when blocks run out."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, new tokens this step)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int):
        self.max_num_seqs = config.max_num_seqs
        self.token_budget = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.max_model_len = max_model_len
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest first: the last one is preempted first
        self.num_preemptions = 0
        self.num_chunked_prefills = 0  # prefill steps that did not reach the end of the prompt
        self.num_scheduled_tokens = 0  # tokens run through the model, prefill and decode

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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
        while self.waiting and budget > 0:
            req = self.waiting[0]
            seqs = 1 if req.forked else req.sampling_params.n  # an unforked parent becomes n streams
            if self.running and len(self.running) + seqs > self.max_num_seqs:
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
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
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
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request wherever it is and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
