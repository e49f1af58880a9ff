"""ModelRunner: owns the weights and the KV cache tensors, turns a scheduled batch into flat
tensors, runs one forward pass over it, and returns the logits to sample from."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field

import torch

import kernels
from engine.config import EngineConfig
from engine.host_memory import keep_freed_memory
from engine.layers.context import AttentionMetadata, forward_context
from engine.layers.linear import pack_weights
from engine.loader import ModelSource, checkpoint_tensors, load_weights
from engine.models.registry import model_class
from engine.distributed.state import min_over_ranks, pp_state, tp_state
from engine.planning import ModelSpec, kv_budget_bytes, kv_bytes_per_token, kv_capacity_tokens
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SchedulerOutput

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


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@dataclass
class StepLogits:
    """Logits of one step: one row per stream that reached the end of its known tokens
    (sample from these), plus, for requests that asked for prompt logprobs, a row per prompt
    position of this chunk: (request, index of the first prompt token they score, rows)."""

    sample_reqs: list[Request]
    sample_logits: torch.Tensor | None
    prompt_logits: list[tuple[Request, int, torch.Tensor]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else _DTYPES[config.kv_cache_dtype]
        if self.device.type == "cpu":
            keep_freed_memory()
            if config.num_threads:
                torch.set_num_threads(config.num_threads)
        # The kernels, chosen once: the backend's name (for reports) and its ops, which every layer
        # reaches through the forward context execute_model sets.
        self.attn_backend = kernels.resolve_backend(config.attention_backend, self.device.type)
        self.backend = kernels.get_backend(self.attn_backend)
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
        self.model.eval()
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
        req = Request("profile", [0] * n, SamplingParams(max_tokens=1))
        req.block_ids = list(range(self.num_blocks))
        batch = SchedulerOutput(scheduled=[(req, n)])
        self.execute_model(batch)
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

    @torch.inference_mode()
    def execute_model(self, batch: SchedulerOutput) -> StepLogits:
        bs = self.block_size
        ids, positions, slots, seq_lens, tables = [], [], [], [], []
        query_start = [0]
        sample_rows, sample_reqs, prompt_rows = [], [], []
        for req, n in batch.scheduled:
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            ids += req.token_ids_slice(start, end)
            positions += range(start, end)
            blocks = req.block_ids
            slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            query_start.append(query_start[-1] + n)
            seq_lens.append(end)
            tables.append(blocks)
            if req.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                # Row p scores prompt token p + 1.
                last = min(end, req.num_prompt_tokens - 1)
                prompt_rows.append((req, start + 1, query_start[-2], query_start[-2] + last - start))
            if end == req.num_tokens:
                sample_rows.append(query_start[-1] - 1)
                sample_reqs.append(req)
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
            out = StepLogits(sample_reqs, None)
            if sample_rows:
                rows = torch.tensor(sample_rows, device=dev)
                h = self.model.final_hidden(hidden[rows], residual[rows])
                out.sample_logits = self.model.compute_logits(h)
            for req, first_token, a, b in prompt_rows:
                h = self.model.final_hidden(hidden[a:b], residual[a:b])
                out.prompt_logits.append((req, first_token, self.model.compute_logits(h).float()))
        return out
