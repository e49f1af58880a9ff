"""Vocab-parallel embedding and LM head: each rank owns a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.state import tp_all_gather_last_dim, tp_all_reduce, tp_state
from engine.layers.context import get_forward_context


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        tp = tp_state()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)  # last rank's slice is padded
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = loaded[self.start: self.start + self.per_rank]
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_state().size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * mine.unsqueeze(-1)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary slice, gathered so every rank sees the full row."""

    packed_weight = None  # set by engine.layers.linear.pack_weights

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = get_forward_context().backend.linear(hidden, self.weight, None, self.packed_weight)
        logits = tp_all_gather_last_dim(local)
        return logits[..., : self.vocab_size]
