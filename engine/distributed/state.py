"""Which tensor-parallel rank, pipeline stage and expert shard this process is. Single-process defaults: rank 0
of 1, stage 0 of 1 owning every layer.

`engine.distributed.groups` sets these when it builds the process groups; layers read them at
construction so each rank builds (and loads) only its shard, and the model reads the stage to
know whether it embeds, receives activations, sends them on, or computes logits.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TensorParallelState:
    rank: int = 0
    size: int = 1
    group: object | None = None  # torch.distributed ProcessGroup when size > 1


@dataclass
class PipelineParallelState:
    rank: int = 0  # this stage
    size: int = 1
    layer_range: tuple[int, int] | None = None  # None: every layer (single stage)
    prev_rank: int | None = None  # global rank of the previous stage's process with our TP rank
    next_rank: int | None = None
    group: object | None = None  # group for stage-to-stage send/recv (the device group)


@dataclass
class ExpertParallelState:
    """Expert parallel: a stage's TP ranks split the experts of each MoE layer between them, whole
    experts per rank, instead of each rank holding a slice of every expert. Attention stays tensor
    parallel, so every rank already has every token's hidden state: each computes its own experts'
    share and the shares meet in the same all-reduce (over the TP group) a row-parallel layer ends
    with. size 1: experts are sliced like any MLP."""

    rank: int = 0
    size: int = 1


@dataclass
class WorldState:
    """Every process of one engine replica (TP x PP ranks)."""

    rank: int = 0
    size: int = 1
    cpu_group: object | None = None  # gloo group over the replica, for small CPU-side agreements


_tp = TensorParallelState()
_pp = PipelineParallelState()
_world = WorldState()
_ep = ExpertParallelState()


def tp_state() -> TensorParallelState:
    return _tp


def pp_state() -> PipelineParallelState:
    return _pp


def world_state() -> WorldState:
    return _world


def ep_state() -> ExpertParallelState:
    return _ep


def set_parallel_state(tp: TensorParallelState, pp: PipelineParallelState, world: WorldState,
                       ep: ExpertParallelState | None = None) -> None:
    global _tp, _pp, _world, _ep
    _tp, _pp, _world, _ep = tp, pp, world, ep or ExpertParallelState()


def reset_parallel_state() -> None:
    """Back to single-process defaults (after a parallel engine shuts down)."""
    set_parallel_state(TensorParallelState(), PipelineParallelState(), WorldState())


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


def min_over_ranks(value: int) -> int:
    """The smallest of every rank's value, e.g. the KV blocks that fit on every rank of a replica
    (ranks hold different layers and profile different peaks, but share one block table)."""
    if _world.size == 1:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_world.cpu_group)
    return int(t.item())
