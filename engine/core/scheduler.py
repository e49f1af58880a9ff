"""Token-budget scheduler: running requests first (decodes and unfinished prefill chunks),
then waiting prompts, chunked to fit the budget; preempts the newest request when blocks run out.

It owns the KV cache manager: it allocates a request's blocks when it schedules it, hashes the
blocks a step filled, forks the prompt's blocks to an n > 1 request's other choices, and frees
a request's blocks when it is preempted or ends. Nothing else changes block ownership.

Its output is plain data (engine/scheduler_output.py): a stream goes to the runner whole once,
then only what changed; it tracks on each Request what the runner already holds.

With speculative decoding on, a decoding stream that may speculate (speculates()) gets draft
tokens (engine/core/ngram_proposer.py) computed in the same step after its last token; only the
ones the model agrees with count as computed (accept_drafts), and blocks that held nothing but
rejected drafts go back to the pool; a stream whose drafts keep failing backs off
(engine/core/draft_backoff.py)."""

from __future__ import annotations

import math
from collections import deque

from engine.config import EngineConfig
from engine.core import ngram_proposer
from engine.core.draft_backoff import DraftBackoff
from engine.core.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


UNLIMITED = 1 << 62  # a prefill limit left unset beside one that is set


def speculates(p: SamplingParams) -> bool:
    """Whether a request's tokens may come from verified drafts: what the sampler does at a row is
    computable at each draft's position (temperature, top-k/p, min-p, penalties, logit_bias,
    allowed_token_ids, bad_words and min_tokens read the drafts before it as output; the runner
    verifies with the sampler's own choice there, and reports each verified token's logprobs from its
    row). Refused: structured output (its matcher would have to advance over the drafts and roll back
    over the rejected ones) and pooling (nothing is decoded)."""
    return p.pooling is None and p.structured_outputs is None


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int, cpu: bool = False):
        """`cpu`: the step runs on CPU, where its prefill is also held to config.cpu_max_prefill_*."""
        self.max_num_seqs = config.max_num_seqs
        self.token_budget = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        limits = (config.cpu_max_prefill_tokens, config.cpu_max_prefill_attention)
        limited = cpu and self.chunked_prefill and limits != (None, None)  # unset offline: whole budgets
        self.prefill_token_budget = (limits[0] or UNLIMITED) if limited else None
        self.prefill_attention_budget = (limits[1] or UNLIMITED) if limited else None
        self._prefill_left = (self.prefill_token_budget, self.prefill_attention_budget)  # in the step being scheduled
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
        # The step in progress (schedule() to update_computed()): what it runs, by stream key the
        # streams it samples (forks included), and the choices it forked, for the core to adopt.
        self.scheduled: list[tuple[Request, int]] = []
        self.step_streams: dict[str, Request] = {}
        self.forked: list[Request] = []
        self._finished_ids: list[str] = []  # streams the runner still holds, to name in the next output
        # LoRA: the most adapters the running requests may use at once (the runner's slots).
        self.max_loras = config.max_loras if config.enable_lora else 0
        self.speculative = config.speculative_config  # validated: method ngram, its k and n-gram lengths
        self.drafts: dict[str, list[int]] = {}  # this step's draft tokens, by stream key
        self.backoff: dict[str, DraftBackoff] = {}  # by stream key: streams whose drafts were verified

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self._enqueue(request, front=False)

    def _fork(self, first: Request, num_computed: int, out: SchedulerOutput) -> None:
        """`first`'s prompt completes in this step: give its other choices the prompt's blocks, to
        sample from the same logits row now and decode from the next step. A partial last block
        is copied after the forward; a choice that finds no block free for that copy waits and
        recomputes its prompt."""
        first.forked = True
        for i in range(1, first.sampling_params.n):
            child = Request(first.request_id, first.prompt_token_ids, first.sampling_params, index=i,
                            lora_request=first.lora_request)
            child.forked = True
            self.forked.append(child)
            copies = self.kv.fork(first, child, num_computed)
            if copies is None:
                self.add(child)
                continue
            child.status = RequestStatus.RUNNING
            child.num_sent_tokens, child.num_sent_blocks = child.num_tokens, len(child.block_ids)
            out.forks.append((first.key, self._new_data(child)))
            out.block_copies += copies
            self.step_streams[child.key] = child

    def update_computed(self) -> None:
        """After the forward: the scheduled tokens' K/V are in the cache; hash the blocks they
        filled. Forked choices join the running ones (they decode from the next step)."""
        for req, n in self.scheduled:
            req.num_computed_tokens += n - len(self.drafts.get(req.key, ()))  # drafts count once accepted
            self.kv.cache_full_blocks(req)
        self.running += [c for c in self.forked if c.status == RequestStatus.RUNNING]
        self.scheduled, self.forked = [], []

    def accept_drafts(self, req: Request, num_accepted: int) -> None:
        """After the core appended a speculating stream's tokens (it did not finish): the first
        `num_accepted` drafts' K/V stand; blocks that hold only rejected positions are freed
        (never hashed: cache_full_blocks reads computed tokens only)."""
        req.num_computed_tokens += num_accepted
        self.backoff.setdefault(req.key, DraftBackoff()).record(num_accepted)
        keep = self.kv.blocks_needed(req.num_computed_tokens)
        if len(req.block_ids) > keep:
            self.kv.free_tail(req, keep)
            req.num_sent_blocks = min(req.num_sent_blocks, keep)
        self.kv.cache_full_blocks(req)

    def _propose(self, req: Request, budget: int, num_later: int) -> list[int]:
        """Draft tokens for a decoding stream, as many as the step's budget, the context window,
        max_tokens and the free blocks allow, keeping one free block for each of the `num_later`
        running streams scheduled after it (a draft never preempts a request)."""
        spec, p = self.speculative, req.sampling_params
        if spec is None or budget < 2 or not req.output_token_ids or not speculates(p):
            return []
        backoff = self.backoff.get(req.key)
        if backoff is not None and not backoff.proposes():
            return []
        room = (len(req.block_ids) + self.kv.num_free_blocks - num_later) * self.kv.block_size
        k = min(spec["num_speculative_tokens"], budget - 1, self.max_model_len - req.num_tokens,
                room - req.num_tokens)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - len(req.output_token_ids) - 1)  # the model's own token follows the drafts
        if k < 1:
            return []
        return ngram_proposer.propose(req.all_token_ids, k, spec["prompt_lookup_min"], spec["prompt_lookup_max"])

    @property
    def num_running_seqs(self) -> int:
        """Sequence slots the running requests hold (an unforked parent in its prefill holds n)."""
        return sum(self._seqs(r) for r in self.running)

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

    def _prefill_limit(self, start: int, n: int) -> int:
        """The tokens of a chunk of n, after `start` computed ones, that fit what is left of this
        step's prefill budgets (at least one for the step's first chunk, so that prefill goes on)."""
        if n == 1 or self.prefill_token_budget is None:
            return n  # a decode, or no limit
        tokens, pairs = self._prefill_left
        first = tokens == self.prefill_token_budget
        # The largest n with n*start + n*(n+1)/2 pairs within what is left (the quadratic formula).
        b = 2 * start + 1
        fit = (math.isqrt(b * b + 8 * pairs) - b) // 2 if pairs > 0 else 0
        n = max(min(n, tokens, fit), 1 if first else 0)
        self._prefill_left = (tokens - n, pairs - (n * start + n * (n + 1) // 2))
        return n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self.scheduled, self.step_streams, self.forked, self.drafts = [], {}, [], {}
        self._prefill_left = (self.prefill_token_budget, self.prefill_attention_budget)
        budget = self.token_budget
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_tokens - req.num_computed_tokens == 1:
                drafts = self._propose(req, budget, len(self.running) - i - 1)
                if drafts and self.kv.allocate_slots(req, 1 + len(drafts)):
                    self.drafts[req.key] = drafts
                    self.scheduled.append((req, 1 + len(drafts)))
                    budget -= 1 + len(drafts)
                    i += 1
                    continue
            n = self._prefill_limit(req.num_computed_tokens, min(req.num_tokens - req.num_computed_tokens, budget))
            if n == 0:  # this step's prefill budget is spent: its chunk waits for the next step
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                self.scheduled.append((req, n))
                budget -= n
                i += 1
        if preempted:  # blocks are short: admit nothing new this step
            return self._finish_output(out)
        # An unforked parent in its prefill already holds the slots of its n choices.
        running_seqs = self.num_running_seqs
        adapters = {r.lora_int_id for r in self.running} - {0}
        skipped: list[Request] = []  # their adapter finds no slot free: they wait, later requests may start
        while budget > 0:
            self._drop_finished_head()
            if not self.waiting:
                break
            req = self.waiting[0]
            # Admission refuses n > max_num_seqs, so a request that does not fit now fits later.
            if running_seqs + self._seqs(req) > self.max_num_seqs:
                break
            if req.lora_int_id and req.lora_int_id not in adapters and len(adapters) >= self.max_loras:
                self._pop_waiting()
                skipped.append(req)
                continue
            cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            remaining = req.num_tokens - req.num_computed_tokens - len(cached) * self.kv.block_size
            if not self.chunked_prefill and remaining > budget:
                break
            n = self._prefill_limit(req.num_computed_tokens + len(cached) * self.kv.block_size, min(remaining, budget))
            if n == 0 or not self.kv.allocate_slots(req, n, cached):
                break
            if req.status == RequestStatus.WAITING:
                self.kv.record_prefix_lookup(req, cached)
            self._pop_waiting()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            running_seqs += self._seqs(req)
            adapters.add(req.lora_int_id)
            adapters.discard(0)
            self.scheduled.append((req, n))
            budget -= n
        for req in reversed(skipped):
            self._enqueue(req, front=True)
        return self._finish_output(out)

    def _finish_output(self, out: SchedulerOutput) -> SchedulerOutput:
        """Fill the step's plain output from self.scheduled: each stream whole if the runner does
        not know it, else only what changed since it last went; then the forks."""
        for req, n in self.scheduled:
            if req.num_sent_tokens == 0:
                out.new_reqs.append(self._new_data(req))
            else:
                out.cached_reqs.append(CachedRequestData(
                    req.key, req.token_ids_slice(req.num_sent_tokens, req.num_tokens),
                    req.block_ids[0 if req.resumed else req.num_sent_blocks:], req.num_computed_tokens, req.resumed,
                    None if req.resumed else req.num_sent_blocks))
            req.num_sent_tokens, req.num_sent_blocks, req.resumed = req.num_tokens, len(req.block_ids), False
            out.num_scheduled_tokens.append((req.key, n))
            self.step_streams[req.key] = req
            if not req.forked and req.num_computed_tokens + n == req.num_tokens:
                self._fork(req, req.num_tokens, out)
        out.draft_token_ids = self.drafts
        if out:  # else nothing runs: the runner hears of the finished streams next time
            out.finished_req_ids, self._finished_ids = self._finished_ids, []
        self.num_scheduled_tokens += out.num_tokens
        self.num_chunked_prefills += sum(1 for r, n in self.scheduled if r.num_computed_tokens + n < r.num_tokens)
        return out

    @staticmethod
    def _new_data(req: Request) -> NewRequestData:
        return NewRequestData(req.key, req.index, req.prompt_token_ids, list(req.output_token_ids),
                              req.sampling_params, list(req.block_ids), req.num_computed_tokens, req.lora_request)

    def _preempt(self, req: Request) -> None:
        """Drop the request's KV and queue it first in line; it will recompute its tokens."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.resumed = req.num_sent_tokens > 0  # the runner keeps the stream (its generator) but not its blocks
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
        self.backoff.pop(req.key, None)
        req.status = RequestStatus.FINISHED
        if req.num_sent_tokens:
            self._finished_ids.append(req.key)
