"""EngineCore.step(): schedule -> execute (forward and sampling, in the runner) -> update. Not
thread-safe: one thread drives it.

A step emits CoreOutputs: per choice, the tokens it got (one, or several when it verified draft
tokens) and whether it ended (EOS, a stop token id, max_tokens, the context window: checked token
by token, so nothing after a stop is emitted). Text is the front end's (engine/output_processor.py): it
finds stop strings and ends those choices here with `finish_choice`.
"""

from __future__ import annotations

import dataclasses
import logging

from engine.config import EngineConfig
from engine.core.admission import Limits, check_lora, check_request
from engine.core.kv_cache import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.loading.loader import ModelSource
from engine.outputs import CoreOutput
from engine.request import LoRARequest, ParentRequest, Request
from engine.runner import bad_words
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SampledToken

logger = logging.getLogger(__name__)

_FAILED = object()  # what _guarded returns when the call failed its request


class EngineCore:
    def __init__(self, config: EngineConfig, source: ModelSource, runner):
        """`runner`: what executes a step, built by the front end (engine.frontend.startup): a
        ModelRunner in one process, rank 0's ParallelExecutor under TP x PP; same interface."""
        self.config = config
        self.tokenizer = source.tokenizer
        self.model_name = source.name
        self.sampling_defaults = source.sampling_defaults
        self.eos_token_ids = source.eos_token_ids
        self.runner = runner
        self.vocab_size = source.hf_config.vocab_size
        capacity = self.runner.num_blocks * config.block_size
        self.max_model_len = self.runner.max_model_len
        if self.max_model_len > capacity:
            if config.max_model_len is not None:
                raise ValueError(
                    f"max_model_len {config.max_model_len} does not fit the KV cache ({capacity} tokens): "
                    "lower max_model_len or raise kv_cache_memory / gpu_memory_utilization")
            logger.warning("max_model_len lowered from %d to the KV cache capacity, %d tokens",
                           self.max_model_len, capacity)
            self.max_model_len = capacity
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) so that every prompt can be scheduled")
        self.limits = Limits.of(config, source.hf_config, self.max_model_len)
        self.scheduler = Scheduler(config, KVCacheManager(self.runner.num_blocks, config.block_size,
                                                          config.enable_prefix_caching), self.max_model_len,
                                   cpu=getattr(self.runner.device, "type", None) == "cpu")
        self.parents: dict[str, ParentRequest] = {}
        self._pending: list[CoreOutput] = []  # aborts, failures and stops, handed out by the next step
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_requests_added = 0  # add_request calls, refused ones too: a front matches its sends to them
        # Speculative decoding: draft runs (a stream's drafts of one step) and draft tokens verified,
        # tokens accepted, and accepted at each draft position; mean accepted length is
        # 1 + num_accepted_tokens / num_drafts (vLLM's).
        k = config.speculative_config["num_speculative_tokens"] if config.speculative_config else 0
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * k
        logger.info("KV cache: %d blocks of %d tokens = %d tokens (%d bytes/token, %s, %s); max_model_len %d",
                    self.runner.num_blocks, config.block_size, capacity, self.runner.kv_bytes_per_token(),
                    self.runner.kv_dtype, self.runner.device, self.max_model_len)

    # ---- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> None:
        """Queue a request that check_request passed: the front end that took it checked it once."""
        self.num_requests_added += 1
        if request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = list(prompt_token_ids)
        if sampling_params.bad_words:  # a copy: the caller's params may go to another engine, another tokenizer
            sequences = bad_words.token_sequences(sampling_params.bad_words, self.tokenizer)
            sampling_params = dataclasses.replace(sampling_params, bad_words_token_ids=sequences)
        parent = ParentRequest(request_id, ids, sampling_params, lora_request)
        first = parent.choices[0] = Request(request_id, ids, sampling_params, index=0, arrival_time=arrival_time,
                                            lora_request=lora_request)
        self.parents[request_id] = parent
        self.scheduler.add(first)

    def check_request(self, ids: list[int], params: SamplingParams, lora_request: LoRARequest | None = None) -> None:
        check_request(ids, params, self.limits, lora_request)

    def check_lora(self, lora_request: LoRARequest) -> None:
        check_lora(lora_request, self.limits)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Free the requests' blocks now; the next step reports each unfinished choice as ended
        with reason "abort". O(1) per request (per started choice), however many are queued."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self.parents.pop(rid, None)
            if parent is not None:
                unfinished = parent.unfinished_indexes()
                self._end(parent, "abort")
                self._pending += [CoreOutput(rid, i, finish_reason="abort", request_finished=True)
                                  for i in unfinished]

    def finish_choice(self, request_id: str, index: int, stop: str) -> None:
        """The front end found a stop string in this choice's text: end the choice and free its blocks."""
        parent = self.parents.get(request_id)
        req = parent.choices[index] if parent is not None else None
        if req is None or req.is_finished:
            return
        req.finish_reason, req.stop_reason = "stop", stop
        self.scheduler.finish(req)
        if parent.finished:
            del self.parents[request_id]
        # Reported so that a front that tracks requests (data parallel) sees the request end.
        self._pending.append(CoreOutput(request_id, index, finish_reason="stop", stop_reason=stop,
                                        request_finished=parent.finished))

    def _end(self, parent: ParentRequest, reason: str) -> None:
        parent.ended = True
        for s in parent.choices:
            if s is not None and not s.is_finished:
                s.finish_reason = reason
                self.scheduler.finish(s)

    def _fail(self, parent: ParentRequest, error: BaseException | str, invalid: str | None = None) -> None:
        """One request's step data raised: end that request alone, with an error output (`invalid`:
        the message for its client, whose parameters asked for the impossible; not an engine fault)."""
        if invalid is not None:
            logger.info("request %s ended: %s", parent.request_id, invalid)
        elif isinstance(error, BaseException):
            logger.error("request %s failed; the engine goes on", parent.request_id, exc_info=error)
            error = type(error).__name__
        else:
            logger.error("request %s failed in the runner (%s); the engine goes on", parent.request_id, error)
        self.parents.pop(parent.request_id, None)
        self._end(parent, "abort")
        self._pending.append(CoreOutput(parent.request_id, 0, finish_reason="abort", request_finished=True,
                                        error=invalid or f"internal error while processing the request ({error})",
                                        invalid_request=invalid is not None))

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents) or bool(self._pending)

    # ---- one step -------------------------------------------------------------------------------

    def step(self) -> list[CoreOutput]:
        """One forward for the scheduled batch. Only the forward may raise out of here: anything
        that fails on one request's data (sampling and prompt logprobs in the runner, stops and
        output here) fails that request."""
        outputs, self._pending = self._pending, []
        if not self.scheduler.has_work():
            return outputs
        batch = self.scheduler.schedule()
        for child in self.scheduler.forked:  # n > 1: the choices forked as the prompt completes
            self.parents[child.request_id].choices[child.index] = child
        if not batch:
            return outputs
        result = self.runner.execute_model(batch)
        self.scheduler.update_computed()
        streams = self.scheduler.step_streams
        for key, error, invalid in result.failed:
            parent = self.parents.get(streams[key].request_id)
            if parent is not None:
                self._fail(parent, error, invalid)
        for key, first_token, entries in result.prompt_logprobs:
            req = streams[key]
            self._guarded(req.request_id, self._record_prompt_logprobs, req, first_token, entries)
        for key, vector in result.pooled:
            req = streams[key]
            parent = self.parents.get(req.request_id)
            if parent is not None:
                out = self._guarded(req.request_id, self._finish_pooled, parent, req, vector)
                if out is not _FAILED:
                    outputs.append(out)
        for key, token in result.sampled:
            req = streams[key]
            parent = self.parents.get(req.request_id)
            if parent is None:
                continue  # failed in the runner, or on an earlier choice
            out = self._guarded(req.request_id, self._append_token, parent, req, token)
            if out is not _FAILED:
                outputs.append(out)
        for key, tokens, top_logprobs in result.verified:
            req = streams[key]
            self._count_drafts(len(self.scheduler.drafts[key]), len(tokens) - 1)
            parent = self.parents.get(req.request_id)
            if parent is None:
                continue
            out = self._guarded(req.request_id, self._append_verified, parent, req, tokens, top_logprobs)
            if out is not _FAILED:
                outputs.append(out)
        return outputs + self._take_pending()

    def _count_drafts(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    def _append_verified(self, parent: ParentRequest, req: Request, tokens: list[int],
                         top_logprobs: list) -> CoreOutput:
        """A speculating stream's accepted drafts and the model's next token, as one output; if
        it goes on, its accepted drafts' K/V stand and the rejected ones' blocks are freed."""
        out = self._append(parent, req, tokens, top_logprobs)
        if not req.is_finished:
            self.scheduler.accept_drafts(req, len(tokens) - 1)
        return out

    def _guarded(self, request_id: str, fn, *args):
        """fn(*args); if it raises, fail that request (not the engine) and return _FAILED."""
        try:
            return fn(*args)
        except Exception as e:
            parent = self.parents.get(request_id)
            if parent is not None:
                self._fail(parent, e)
            return _FAILED

    def _take_pending(self) -> list[CoreOutput]:
        pending, self._pending = self._pending, []
        return pending

    def _append_token(self, parent: ParentRequest, req: Request, result: SampledToken) -> CoreOutput:
        return self._append(parent, req, [result.token_id], [result.top_logprobs])

    def _append(self, parent: ParentRequest, req: Request, tokens: list[int], top_logprobs: list | None) -> CoreOutput:
        """Append the tokens one by one until one ends the choice (the rest are dropped)."""
        if not req.output_token_ids and req.index == 0 and req.num_computed_tokens == req.num_prompt_tokens:
            self.prompt_tokens_total += req.num_prompt_tokens
            parent.num_cached_tokens = req.num_cached_tokens
        p = req.sampling_params
        first = not req.output_token_ids
        reason, stop_reason = None, None
        emitted = []
        for tok in tokens:
            req.output_token_ids.append(tok)
            emitted.append(tok)
            self.generation_tokens_total += 1
            n_out = len(req.output_token_ids)
            if tok in self.eos_token_ids and (p.structured_outputs is not None or (n_out >= p.min_tokens
                                                                                 and not p.ignore_eos)):
                # A grammar took the end token, so it has ended, and no token can follow it: the output
                # stops there whatever min_tokens or ignore_eos ask (the sampler let it end only then).
                reason = "stop"
            elif n_out >= p.min_tokens and tok in p.stop_token_ids:
                reason, stop_reason = "stop", tok
            elif (p.max_tokens is not None and n_out >= p.max_tokens) or req.num_tokens >= self.max_model_len:
                reason = "length"
            if reason is not None:
                break
        if reason is not None:
            req.finish_reason, req.stop_reason = reason, stop_reason
            self.scheduler.finish(req)
        out = CoreOutput(req.request_id, req.index, emitted,
                         top_logprobs[:len(emitted)] if p.logprobs is not None else None, reason, stop_reason)
        if req.index == 0 and first:  # the request's first output carries what the prompt gave
            out.prompt_logprobs, out.num_cached_tokens = req.prompt_logprobs, parent.num_cached_tokens
        if parent.finished:
            out.request_finished = True
            del self.parents[req.request_id]
        return out

    def _finish_pooled(self, parent: ParentRequest, req: Request, embedding: list[float]) -> CoreOutput:
        """An embedding request's prompt is done: it ends with its embedding, generating nothing."""
        self.prompt_tokens_total += req.num_prompt_tokens
        req.finish_reason = "stop"
        self.scheduler.finish(req)
        del self.parents[req.request_id]
        return CoreOutput(req.request_id, 0, finish_reason="stop", request_finished=True,
                          num_cached_tokens=req.num_cached_tokens, embedding=embedding)

    @staticmethod
    def _record_prompt_logprobs(req: Request, first_token: int, entries: list[dict[int, float]]) -> None:
        skip = len(req.prompt_logprobs) - first_token  # entries already recorded before a preemption
        req.prompt_logprobs += entries[max(skip, 0):]

    # ---- lifecycle ----------------------------------------------------------------------------------

    def check_health(self) -> None:
        """Raises if the engine cannot step any more (a parallel worker process died)."""
        check = getattr(self.runner, "check_health", None)
        if check is not None:
            check()

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel runner; a local runner has nothing to stop."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()

    # ---- introspection ----------------------------------------------------------------------------

    def stats(self) -> dict:
        kv = self.scheduler.kv
        return {
            "num_running": len(self.scheduler.running),
            "num_running_seqs": self.scheduler.num_running_seqs,
            "num_waiting": self.scheduler.num_waiting,
            "num_waiting_seqs": self.scheduler.num_waiting_seqs,
            "kv_cache_usage": kv.usage,
            "num_used_blocks": kv.num_blocks - kv.num_free_blocks,
            "num_total_blocks": kv.num_blocks,
            "prefix_cache_hit_rate": kv.hit_rate,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_chunked_prefills": self.scheduler.num_chunked_prefills,
            "num_scheduled_tokens": self.scheduler.num_scheduled_tokens,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_requests_added": self.num_requests_added,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
        }
