"""Mixture-of-experts layers: the router and the experts of one sparse MLP, stacked.

Every expert of a layer lives in two stacked parameters, w13 [experts, 2 * ffn, hidden] (gate rows,
then up rows) and w2 [experts, hidden, ffn], so that loading, packing and sharding deal with one
shape, and the backend's fused op runs them all in one call. A rank holds either a slice of every
expert's ffn (tensor parallel, the default) or whole experts (expert parallel, `ep_state()`); both
give a partial sum that the caller reduces over the TP group, once, with anything else it adds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.state import ep_state, tp_state
from engine.layers.context import get_forward_context

# Checkpoint names of an expert's three matrices -> the part of w13 / w2 they fill.
# Mixtral: w1 (gate), w3 (up), w2 (down); Qwen MoE and stacked checkpoints: gate/up/down_proj.
EXPERT_PARTS = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down",
                "gate_up_proj": "gate_up"}


class Router(nn.Module):
    """The gate: one logit per expert for each token, computed and kept in float32 (its weight
    is stored in float32 whatever the model's dtype), so that near ties between experts are not
    decided by bfloat16 rounding."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class FusedMoE(nn.Module):
    """The experts of one layer. forward(x, router_logits) -> this rank's partial sum [T, hidden],
    in x's dtype: each token's top-k experts, weighted by their routing probabilities."""

    packed = None  # the backend's packed w13 / w2 (pack_experts), when it packs

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, ffn: int, renormalize: bool):
        super().__init__()
        tp, ep = tp_state(), ep_state()
        self.top_k, self.renormalize = top_k, renormalize
        if ep.size > 1:  # whole experts [offset, offset + local) here, unsliced
            self.num_local_experts = num_experts // ep.size
            self.expert_offset = ep.rank * self.num_local_experts
            self.ffn_per_rank, self.ffn_rank = ffn, 0
        else:  # every expert, a 1/tp slice of each one's ffn
            self.num_local_experts, self.expert_offset = num_experts, 0
            self.ffn_per_rank, self.ffn_rank = ffn // tp.size, tp.rank
        shape13 = (self.num_local_experts, 2 * self.ffn_per_rank, hidden_size)
        shape2 = (self.num_local_experts, hidden_size, self.ffn_per_rank)
        self.w13 = nn.Parameter(torch.empty(shape13), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(shape2), requires_grad=False)
        self.w13.weight_loader = self.w2.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple[int | None, str]) -> None:
        """shard = (expert id, part): one expert's gate / up / down matrix, or (None, part): the
        part of every expert, stacked on a first dimension (transformers 5's fused layout, GGUF)."""
        expert, part = shard
        if expert is None:
            for e in range(self.num_local_experts):
                self._load_expert(param, loaded[self.expert_offset + e], e, part)
        elif 0 <= expert - self.expert_offset < self.num_local_experts:  # else another rank's expert
            self._load_expert(param, loaded, expert - self.expert_offset, part)

    def _load_expert(self, param: nn.Parameter, w: torch.Tensor, e: int, part: str) -> None:
        n, start = self.ffn_per_rank, self.ffn_rank * self.ffn_per_rank
        if part == "down":
            param.data[e].copy_(w.narrow(1, start, n))
        elif part == "gate_up":
            half = w.shape[0] // 2
            param.data[e, :n].copy_(w.narrow(0, start, n))
            param.data[e, n:].copy_(w.narrow(0, half + start, n))
        else:
            param.data[e].narrow(0, 0 if part == "gate" else n, n).copy_(w.narrow(0, start, n))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        backend = get_forward_context().backend
        weights, ids = backend.select_experts(router_logits, self.top_k, self.renormalize)
        return backend.fused_moe(x, weights, ids, self.w13, self.w2, self.expert_offset, self.packed)


def pack_experts(model: nn.Module, pack_moe_weights: Callable) -> None:
    """Give every FusedMoE its backend-packed weights once loaded, and free the plain copies
    (one resident copy of the experts, as pack_weights does for the linears)."""
    for module in model.modules():
        if isinstance(module, FusedMoE):
            module.packed = pack_moe_weights(module.w13, module.w2)
            if module.packed is not None:
                for p in (module.w13, module.w2):
                    p.data = p.data.new_empty(0)


def packed_expert_bytes(model: nn.Module) -> int:
    """Bytes of the packed expert weights pack_experts made (not among the model's parameters)."""
    return sum(m.packed.nbytes for m in model.modules() if isinstance(m, FusedMoE) and m.packed is not None)
