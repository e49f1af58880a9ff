"""Vocab-parallel embedding and LM head: each rank owns a contiguous slice of the vocabulary.

Either holds its rows as float (the model's dtype) or, after quantize_weight(format), as a GGUF block
format's raw blocks (a GGUF file's token_embd / output tensors kept as stored): the lookup then
dequantizes only the rows it reads, and the LM head multiplies by the blocks with the format's
matmul, so a tied vocabulary matrix is held, and read each step, at its stored size."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.state import tp_all_gather_last_dim, tp_all_reduce, tp_state
from engine.layers.context import get_forward_context
from engine.layers.linear import copy_rows, block_parameter
from engine.quant import BlockFormat


class VocabParallelEmbedding(nn.Module):
    quant_format: BlockFormat | None = None  # set by quantize_weight
    # A tied LM head's packed copy of these blocks (engine.layers.linear.pack_weights), which the
    # lookup then reads, so the blocks themselves are freed: the vocabulary is held once.
    packed_rows = None

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        tp = tp_state()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)  # last rank's slice is padded
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.dtype = self.weight.dtype  # of the rows looked up, whatever the weight is held as

    def quantize_weight(self, fmt: BlockFormat) -> None:
        """Hold the rows as `fmt`'s raw blocks from now on (before the checkpoint loads)."""
        self.weight = block_parameter(self.weight, fmt)
        self.quant_format = fmt

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        rows = max(0, min(self.per_rank, loaded.shape[0] - self.start))
        copy_rows(param, 0, rows, loaded.narrow(0, self.start, rows))

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant_format is None:
            return F.embedding(ids, self.weight)
        rows = self.quant_format.rows(self.weight, ids.reshape(-1), get_forward_context().backend.name,
                                      self.packed_rows)
        return rows.to(self.dtype).reshape(*ids.shape, -1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_state().size == 1:
            return self._rows(ids)
        local = ids - self.start
        mine = (local >= 0) & (local < self.per_rank)
        out = self._rows(local.clamp(0, self.per_rank - 1)) * mine.unsqueeze(-1)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary slice, gathered so every rank sees the full row."""

    packed_weight = None  # set by engine.layers.linear.pack_weights
    activations: str | None = None  # "int16" / "int8": the cpu backend quantizes them (the runner sets it)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Use the embedding's matrix (as it is held: float, or blocks) as this head's weight."""
        self.weight = embedding.weight
        self.quant_format = embedding.quant_format

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        backend = get_forward_context().backend
        if self.quant_format is not None:
            local = self.quant_format.linear(hidden, self.weight, None, backend.name, self.activations,
                                             self.packed_weight)
        else:
            local = backend.linear(hidden, self.weight, None, self.packed_weight)
        logits = tp_all_gather_last_dim(local)
        return logits[..., : self.vocab_size]
