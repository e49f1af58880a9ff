"""Paged attention layer: rotates this step's queries and keys, stores the keys and values, then
attends through the block tables. The batch layout and the backend come from the forward context
(engine/layers/context.py)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.context import get_forward_context


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 sinks: torch.Tensor | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # The kernels' optional features (kernels/reference.py): keys this far back at most, scores
        # capped as cap * tanh(s / cap), one extra softmax logit per query head; None turns each off.
        self.sliding_window, self.logits_soft_cap, self.sinks = sliding_window, logits_soft_cap, sinks
        # Bound by the model runner once the cache is allocated.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # An fp8 cache's per-tensor scales (stored = x / scale, read = e4m3 * scale). 1.0, as vLLM
        # uses when a checkpoint brings no calibrated ones; other cache dtypes ignore them.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, qk: torch.Tensor, v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """qk [tokens, num_heads + num_kv_heads, head_dim]: the queries then the keys, not yet
        rotated; v [tokens, num_kv_heads, head_dim]; rope: the step's (cos, sin). Rotary and the KV
        store are one backend op (a single kernel on triton)."""
        context = get_forward_context()
        meta, backend = context.attn, context.backend
        qk = backend.rotary_write_kv(qk, v, *rope, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale,
                                     self.v_scale)
        q = qk[:, :self.num_heads]
        return backend.paged_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.query_start_loc,
                                       meta.seq_lens, self.scale, plan=meta.plan, k_scale=self.k_scale,
                                       v_scale=self.v_scale, sliding_window=self.sliding_window,
                                       logits_soft_cap=self.logits_soft_cap, sinks=self.sinks)
