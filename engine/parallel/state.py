"""Which tensor-parallel rank this process is. Single-process defaults: rank 0 of 1.

The parallel issue sets these when it builds process groups; layers read them at construction
so each rank builds (and loads) only its shard.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TensorParallelState:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed ProcessGroup when size > 1


_tp = TensorParallelState()


def tp_state() -> TensorParallelState:
    return _tp


def set_tp_state(rank: int, size: int, group=None) -> None:
    global _tp
    _tp = TensorParallelState(rank, size, group)


def tp_all_reduce(x):
    if _tp.size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=_tp.group)
    return x


def tp_all_gather_last_dim(x):
    """Concatenate each rank's slice of the last dimension (vocab-parallel logits)."""
    if _tp.size == 1:
        return x
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_tp.size)]
    dist.all_gather(parts, x.contiguous(), group=_tp.group)
    return torch.cat(parts, dim=-1)
