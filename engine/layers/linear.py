"""Megatron-style linear layers. Each parameter carries a `weight_loader` that copies this
rank's shard of a checkpoint tensor, so the loader never needs to know about sharding."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.distributed.state import tp_all_reduce, tp_state
from engine.layers.context import get_forward_context


def pack_weights(model: nn.Module, pack_linear_weight: Callable) -> None:
    """Give every matmul weight of the model its packed copy (the backend's pack_linear_weight),
    once the checkpoint is loaded, and free the plain copy where nothing else reads it (a tied LM
    head shares its weight with the embedding, which keeps it)."""
    unpacked_users = {id(p) for m in model.modules() if not hasattr(m, "packed_weight")
                      for p in m.parameters(recurse=False)}
    for module in model.modules():
        if not hasattr(module, "packed_weight"):
            continue
        module.packed_weight = pack_linear_weight(module.weight)
        if module.packed_weight is not None and id(module.weight) not in unpacked_users:
            module.weight.data = module.weight.data.new_empty(0)


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the packed weights pack_weights made (not among the model's parameters)."""
    return sum(m.packed_weight.numel() * m.packed_weight.element_size() for m in model.modules()
               if getattr(m, "packed_weight", None) is not None)


def _param(*shape: int, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = loader
    return p


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded)


class ColumnParallelLinear(nn.Module):
    """y = x A^T with A's output rows split across ranks; no communication."""

    packed_weight = None  # set by pack_weights

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        tp = tp_state()
        assert out_features % tp.size == 0, f"{out_features} output features do not split over {tp.size} ranks"
        self.out_per_rank = out_features // tp.size
        self.weight = _param(self.out_per_rank, in_features, loader=self.weight_loader)
        self.bias = _param(self.out_per_rank, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rank = tp_state().rank
        param.data.copy_(loaded.narrow(0, rank * self.out_per_rank, self.out_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return get_forward_context().backend.linear(x, self.weight, self.bias, self.packed_weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored as one matrix (gate and up projections)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        tp = tp_state()
        size = self.out_sizes[shard_id] // tp.size
        offset = sum(self.out_sizes[:shard_id]) // tp.size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections. Query heads split evenly; with fewer KV heads than ranks,
    each KV head is replicated on the ranks whose query heads use it."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = tp_state()
        assert num_heads % tp.size == 0, f"{num_heads} attention heads do not split over {tp.size} ranks"
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        if num_kv_heads >= tp.size:
            assert num_kv_heads % tp.size == 0, f"{num_kv_heads} KV heads do not split over {tp.size} ranks"
            self.num_kv_heads = num_kv_heads // tp.size
        else:
            assert tp.size % num_kv_heads == 0, f"{tp.size} ranks cannot share {num_kv_heads} KV heads evenly"
            self.num_kv_heads = 1
        self.total_kv_heads = num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        super().__init__(hidden, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        tp = tp_state()
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q_size, tp.rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            size = kv_size
            # Which KV head serves this rank's query heads: rank // (ranks per KV head).
            kv_head = (tp.rank * self.total_kv_heads // tp.size if self.total_kv_heads < tp.size
                       else tp.rank * self.num_kv_heads)
            start = kv_head * self.head_dim
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))


class RowParallelLinear(nn.Module):
    """y = x A^T with A's input columns split across ranks; partial sums are all-reduced, unless
    `reduce_results` is False: then the caller adds more partial sums and reduces once."""

    packed_weight = None  # set by pack_weights

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True):
        super().__init__()
        tp = tp_state()
        assert reduce_results or not bias, "a bias is added after the reduction"
        self.reduce_results = reduce_results
        assert in_features % tp.size == 0, f"{in_features} input features do not split over {tp.size} ranks"
        self.in_per_rank = in_features // tp.size
        self.weight = _param(out_features, self.in_per_rank, loader=self.weight_loader)
        # The bias is added once, after the reduction (on every rank, identically).
        self.bias = _param(out_features, loader=default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rank = tp_state().rank
        param.data.copy_(loaded.narrow(1, rank * self.in_per_rank, self.in_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = get_forward_context().backend.linear(x, self.weight, None, self.packed_weight)
        if not self.reduce_results:
            return y
        y = tp_all_reduce(y)
        return y + self.bias if self.bias is not None else y
