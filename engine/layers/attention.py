"""Paged attention layer: stores this step's keys and values, then attends through the
block tables. Batch layout is described by AttentionMetadata (see kernels/reference.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import kernels


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    block_tables: torch.Tensor  # [num_seqs, max_blocks]
    query_start_loc: torch.Tensor  # [num_seqs + 1]
    seq_lens: torch.Tensor  # [num_seqs]
    backend: str = "torch"
    plan: object | None = None  # kernels.plan_attention(...): computed once per step, used by every layer


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # Bound by the model runner once the cache is allocated.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        kernels.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, backend=meta.backend)
        return kernels.paged_attention(q, self.k_cache, self.v_cache, meta.block_tables, meta.query_start_loc,
                                       meta.seq_lens, self.scale, backend=meta.backend, plan=meta.plan)
