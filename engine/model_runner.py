"""ModelRunner: owns the weights, the KV cache tensors and its copy of every running stream;
applies each step's SchedulerOutput to those copies, turns the batch into flat tensors, runs one
forward pass, samples the whole batch at once and returns token ids (and the logprobs asked for),
never logits. Under pipeline parallelism only the last stage computes logits and samples (its TP
rank 0); the other ranks run their share of the forward and return None."""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

import kernels
from engine.config import EngineConfig
from engine.host_memory import keep_freed_memory
from engine.layers.context import AttentionMetadata, forward_context
from engine.layers.linear import pack_weights
from engine.cpu_threads import check_openmp_spin, usable_cpus
from engine.layers.moe import pack_experts
from engine.loader import ModelSource, checkpoint_tensors, load_weights
from engine.models.registry import model_class
from engine.distributed.state import min_over_ranks, pp_state, tp_state
from engine.planning import ModelSpec, kv_budget_bytes, kv_bytes_per_token, kv_capacity_tokens
from engine.request import TokenSequence
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device; use device='cpu'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # CPU defaults to float32: exact parity with transformers, and bfloat16 is only faster
        # on CPUs with native bf16 matmuls (pass dtype='bfloat16' there).
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def resolve_kv_dtype(name: str, dtype: torch.dtype, backend: str, device: torch.device) -> torch.dtype:
    """kv_cache_dtype -> the cache's element dtype: "auto" is the model's, "fp8" is e4m3 (vLLM's
    meaning), where the backend can keep it (else ValueError naming the flag)."""
    if name == "auto":
        return dtype
    if name == "fp8":
        error = kernels.fp8_kv_cache_error(backend, device)
        if error is not None:
            raise ValueError(f"kv_cache_dtype 'fp8' (--kv-cache-dtype fp8) {error}; "
                             "use kv_cache_dtype='auto' or a 16-bit kv_cache_dtype")
        return torch.float8_e4m3fn
    return _DTYPES[name]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class CachedRequestState(TokenSequence):
    """The runner's copy of one stream: what its forwards read, plus what the sampler keeps for
    it (a seeded choice's generator, its penalty counts). Kept from the step that sends it
    (NewRequestData) until the step that names it finished, preemptions included, so that a
    seeded stream's draws go on where they stopped."""

    def __init__(self, new: NewRequestData):
        self.req_id = new.req_id
        self.index = new.index
        self.prompt_token_ids = new.prompt_token_ids
        self.output_token_ids = list(new.output_token_ids)
        self.sampling_params = new.sampling_params
        self.block_ids = list(new.block_ids)
        self.num_computed_tokens = new.num_computed_tokens
        self.generator: torch.Generator | None = None
        self.penalty_state = None
        self.logit_bias_tensors = None
        self.pooled_sum: torch.Tensor | None = None  # mean pooling: the final hidden states so far
        self.grammar = None  # structured output: its matcher, on the sampling rank (made at its first sample)


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource):
        self.config = config
        self.requests: dict[str, CachedRequestState] = {}
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if self.device.type == "cpu":
            keep_freed_memory()
            torch.set_num_threads(config.num_threads or usable_cpus())
            check_openmp_spin()
        # The kernels, chosen once: the backend's name (for reports) and its ops, which every layer
        # reaches through the forward context execute_model sets.
        self.attn_backend = kernels.resolve_backend(config.attention_backend, self.device.type)
        self.backend = kernels.get_backend(self.attn_backend)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, self.attn_backend, self.device)
        hf = source.hf_config
        self.hf_config = hf
        self.block_size = config.block_size
        model_len = getattr(hf, "max_position_embeddings", None) or 2048
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings "
                             f"({model_len}); use a value <= {model_len}")
        self.max_model_len = config.max_model_len or model_len
        window = getattr(hf, "sliding_window", None)
        if window and getattr(hf, "use_sliding_window", True) and window < self.max_model_len:
            # Attention here is always full; within the window, full and sliding attention agree.
            logger.warning("limiting max_model_len to the model's sliding window (%d tokens)", window)
            self.max_model_len = window
        with torch.device(self.device), _default_dtype(self.dtype):
            # A pipeline stage builds (and loads) only its own layers; one process builds all.
            self.model = model_class(hf.model_type)(hf, max_positions=model_len, layer_range=pp_state().layer_range)
        load_weights(self.model, checkpoint_tensors(source))
        pack_weights(self.model, self.backend.pack_linear_weight)
        pack_experts(self.model, self.backend.pack_moe_weights)
        self.model.eval()
        # Logits exist on the last stage only, gathered on each of its TP ranks; one of them samples.
        self.last_stage = pp_state().rank == pp_state().size - 1
        self.sampler = (Sampler(source.eos_token_ids, config.seed, self.device)
                        if self.last_stage and tp_state().rank == 0 else None)
        self.source = source  # the tokenizer, for grammars (built at the first constrained request)
        self.spec = ModelSpec.from_hf_config(hf.to_dict())
        self.num_blocks = self._size_kv_cache()
        self._allocate_kv_cache()

    # ---- KV cache -------------------------------------------------------------------------

    def kv_bytes_per_token(self) -> int:
        """On this rank: its TP share of the KV heads, for the layers of its pipeline stage."""
        stage = dataclasses.replace(self.spec, num_layers=len(self.model.layers()))
        return kv_bytes_per_token(stage, self.kv_dtype.itemsize, tp=tp_state().size)

    def _size_kv_cache(self) -> int:
        """Blocks that fit the memory budget (the same functions `engine plan serve` uses)."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = kv_budget_bytes(total, self.config.gpu_memory_utilization, self._profile_peak_bytes())
        else:
            budget = self.config.kv_cache_memory
        tokens = kv_capacity_tokens(budget, self.kv_bytes_per_token(), self.block_size)
        if tokens < self.block_size:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds no block of {self.block_size} tokens at "
                f"{self.kv_bytes_per_token()} bytes per token: raise kv_cache_memory or gpu_memory_utilization")
        # Every rank of a parallel replica shares one block table: keep what fits on all of them.
        return min_over_ranks(tokens // self.block_size)

    def _profile_peak_bytes(self) -> int:
        """Peak memory of weights plus one forward over a full token budget (CUDA only), not
        counting the throwaway cache the profile run needs."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        self.num_blocks = -(-n // self.block_size)
        self._allocate_kv_cache()
        scratch = sum(t.numel() * t.element_size() for t in self.kv_caches)
        torch.cuda.reset_peak_memory_stats(self.device)
        profile = NewRequestData("profile#0", 0, [0] * n, [], SamplingParams(max_tokens=1),
                                 list(range(self.num_blocks)), 0)
        self.execute_model(SchedulerOutput(new_reqs=[profile], num_scheduled_tokens=[("profile#0", n)]))
        self.requests.clear()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    def _allocate_kv_cache(self) -> None:
        self.kv_caches = []
        for layer in self.model.layers():
            attn = layer.self_attn.attn
            shape = (self.num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            attn.k_cache, attn.v_cache = self.backend.allocate_kv_cache(*shape, self.kv_dtype, self.device)
            self.kv_caches += [attn.k_cache, attn.v_cache]
        if self.device.type == "cpu":
            # A zeroed CPU tensor is calloc'ed: its pages are mapped only when first written, and
            # the block pool hands out the least recently freed block first, so the process would
            # grow toward its KV budget for as long as it serves. Touch every page now: memory
            # is committed (or refused) at start, and RSS afterwards says what serving costs.
            for cache in self.kv_caches:
                cache.zero_()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for layer in self.model.layers():
            attn = layer.self_attn.attn
            self.backend.copy_blocks(attn.k_cache, attn.v_cache, src, dst)

    # ---- one step ---------------------------------------------------------------------------

    def update_states(self, sched: SchedulerOutput) -> None:
        """Bring the runner's copies of the streams to where the scheduler has them."""
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in sched.new_reqs:
            self.requests[new.req_id] = CachedRequestState(new)
        for c in sched.cached_reqs:
            state = self.requests[c.req_id]
            state.output_token_ids += c.new_token_ids
            if c.resumed:
                state.block_ids = list(c.new_block_ids)
            else:
                state.block_ids += c.new_block_ids
            state.num_computed_tokens = c.num_computed_tokens
        for _, child in sched.forks:
            self.requests[child.req_id] = CachedRequestState(child)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Apply the step's changes, run its forward, sample; then make the forks' block copies
        (they read blocks this forward wrote). None on a rank that does not sample."""
        self.update_states(sched)
        bs = self.block_size
        ids, positions, slots, seq_lens, tables = [], [], [], [], []
        query_start = [0]
        sample_rows, sample_streams, prompt_rows = [], [], []
        pool_chunks, pool_ends = [], []  # embedding requests: rows to sum (mean), rows that finish one
        children: dict[str, list[CachedRequestState]] = {}
        for parent, child in sched.forks:
            children.setdefault(parent, []).append(self.requests[child.req_id])
        for req_id, n in sched.num_scheduled_tokens:
            state = self.requests[req_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            ids += state.token_ids_slice(start, end)
            positions += range(start, end)
            blocks = state.block_ids
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            tables.append(blocks)
            if state.sampling_params.prompt_logprobs is not None and start < state.num_prompt_tokens - 1:
                # Row p scores prompt token p + 1.
                last = min(end, state.num_prompt_tokens - 1)
                prompt_rows.append((state, start + 1, query_start[-2], query_start[-2] + last - start))
            if state.sampling_params.pooling is not None:
                if state.sampling_params.pooling == "mean":
                    pool_chunks.append((state, start, query_start[-2], query_start[-1]))
                if end == state.num_tokens:
                    pool_ends.append((state, query_start[-1] - 1))
                continue
            if end == state.num_tokens:
                for s in [state, *children.get(req_id, ())]:  # an n > 1 prompt's choices share its row
                    sample_rows.append(query_start[-1] - 1)
                    sample_streams.append(s)
        # Padding rows (the backend's choice; CPU bounds its matmul shapes) compute on token 0 at
        # position 0, store nothing (slot -1) and are never read back.
        pad = self.backend.padded_num_tokens(len(ids)) - len(ids)
        ids += [0] * pad
        positions += [0] * pad
        slots += [-1] * pad
        dev = self.device
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        )
        meta.plan = self.backend.plan_attention(meta.block_tables, meta.query_start_loc, meta.seq_lens, bs)
        with forward_context(meta, self.backend):
            hidden, residual = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev))
            out = None
            if self.last_stage:
                logits = None
                if sample_rows:
                    rows = torch.tensor(sample_rows, device=dev)
                    logits = self.model.compute_logits(self.model.final_hidden(hidden[rows], residual[rows]))
                # Every TP rank of the last stage computes the logits (the vocabulary is gathered
                # across them); only the sampling rank reads them.
                prompt_logits = []
                for state, first, a, b in prompt_rows:
                    h = self.model.final_hidden(hidden[a:b], residual[a:b])
                    prompt_logits.append((state, first, self.model.compute_logits(h).float()))
                if self.sampler is not None:
                    out = ModelRunnerOutput()
                    for state, first, rows in prompt_logits:
                        try:
                            self._prompt_logprobs(out, state, first, rows)
                        except Exception as e:
                            self._failed(out, state, e)
                    if sample_streams:
                        self._sample(out, logits, sample_streams)
                    if pool_chunks or pool_ends:
                        self._pool(out, hidden, residual, pool_chunks, pool_ends)
        self.copy_blocks(sched.block_copies)
        return out

    @staticmethod
    def _failed(out: ModelRunnerOutput, state: CachedRequestState, error: Exception) -> None:
        """This stream's own data made the runner raise: report it (the core fails its request alone)."""
        logger.warning("stream %s failed in the runner: %r", state.req_id, error)
        out.failed.append((state.req_id, type(error).__name__))

    def _sample(self, out: ModelRunnerOutput, logits: torch.Tensor, streams: list[CachedRequestState]) -> None:
        """Sample all rows at once; if the batch raises, sample each stream alone, so that only a
        stream whose own data makes it raise is failed."""
        for state in streams:
            if state.sampling_params.structured_outputs is not None and state.grammar is None:
                try:
                    state.grammar = self._grammars().matcher(state.sampling_params.structured_outputs,
                                                             state.output_token_ids)
                except Exception as e:
                    self._failed(out, state, e)
        failed = {req_id for req_id, _ in out.failed}
        keep = [i for i, s in enumerate(streams) if s.req_id not in failed]
        if len(keep) < len(streams):
            logits, streams = logits[keep], [streams[i] for i in keep]
        try:
            results = list(zip(streams, self.sampler(logits, streams)))
        except Exception:
            logger.warning("batched sampling raised; sampling each stream alone to find the one at fault")
            results = []
            for i, state in enumerate(streams):
                try:
                    results.append((state, self.sampler(logits[i:i + 1], [state])[0]))
                except Exception as e:
                    self._failed(out, state, e)
        for state, token in results:
            if state.grammar is not None and not state.grammar.accept_token(token.token_id):
                # Only a grammar that allows nothing but a banned token gets here (say, EOS under min_tokens).
                self._failed(out, state, ValueError("the sampled token does not follow the stream's grammar"))
                continue
            out.sampled.append((state.req_id, token))

    def _grammars(self):
        if self.sampler.grammars is None:
            from engine.structured_output import StructuredOutputs

            self.sampler.grammars = StructuredOutputs(self.source.tokenizer, self.hf_config.vocab_size,
                                                      self.source.eos_token_ids, self.backend.apply_token_bitmask)
        return self.sampler.grammars

    def _pool(self, out: ModelRunnerOutput, hidden: torch.Tensor, residual: torch.Tensor, chunks: list,
              ends: list) -> None:
        """Embedding requests: sum each chunk's final hidden states (mean pooling, across chunked
        prefill steps; a chunk from position 0 starts over, as after a preemption), and once a
        prompt is done, report the mean or the last token's state, L2-normalised, in float32."""
        for state, start, a, b in chunks:
            part = self.model.final_hidden(hidden[a:b], residual[a:b]).float().sum(0)
            state.pooled_sum = part if start == 0 else state.pooled_sum + part
        for state, row in ends:
            try:
                if state.sampling_params.pooling == "mean":
                    vector = state.pooled_sum / state.num_prompt_tokens
                else:
                    vector = self.model.final_hidden(hidden[row:row + 1], residual[row:row + 1]).float()[0]
                out.pooled.append((state.req_id, torch.nn.functional.normalize(vector, dim=-1).tolist()))
            except Exception as e:
                self._failed(out, state, e)

    @staticmethod
    def _prompt_logprobs(out: ModelRunnerOutput, state: CachedRequestState, first_token: int,
                         rows: torch.Tensor) -> None:
        """Entries for the prompt tokens these rows score: the token's logprob, plus the top
        prompt_logprobs of the row."""
        n_top = state.sampling_params.prompt_logprobs
        lp = torch.log_softmax(rows, dim=-1)
        targets = state.prompt_token_ids[first_token:first_token + lp.shape[0]]
        chosen = lp.gather(-1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
        entries = [{} for _ in targets]
        if n_top:
            vals, top_ids = (x.tolist() for x in torch.topk(lp, n_top, dim=-1))
            entries = [dict(zip(i, v)) for i, v in zip(top_ids, vals)]
        for entry, tok, value in zip(entries, targets, chosen):
            entry[tok] = value
        out.prompt_logprobs.append((state.req_id, first_token, entries))
