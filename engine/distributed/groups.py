"""torch.distributed for one replica: the process groups, and the parallel state that layers and
the model read.

- the default group (NCCL on CUDA, gloo on CPU) only meets the ranks, with a start-up timeout
  long enough for every rank to import and load its shard;
- `device`, same backend, all ranks: stage-to-stage activations and logits to rank 0; and one
  TP subgroup per stage for the all-reduces and gathers;
- `control`, a gloo group on which rank 0 broadcasts each step's inputs. Followers wait on it
  for as long as the server idles, so on their side it has no practical timeout: a dead rank 0
  still surfaces at once (its connections close), and spawned followers also exit with their
  parent. On rank 0's side it is bounded like any wait inside a step (a gloo group's timeout is
  each process's own setting): a broadcast to a hung follower can block the sender, and did;
- `cpu`, a gloo group for small agreements at start-up (how many KV blocks fit everywhere).

Waits within a step are bounded by EngineConfig.distributed_timeout_s (default 60 s): a peer
that hangs mid-step becomes an error, not a silent stall. A peer that dies closes its
connections, and gloo raises within milliseconds.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from engine.distributed.layout import ParallelLayout
from engine.distributed.state import (ExpertParallelState, PipelineParallelState, TensorParallelState, WorldState,
                                   reset_parallel_state, set_parallel_state)

START_TIMEOUT = datetime.timedelta(minutes=10)
IDLE_TIMEOUT = datetime.timedelta(days=365)


def init_distributed(layout: ParallelLayout, rank: int, device: torch.device, init_method: str, local_rank: int,
                     timeout_s: float):
    """Join the replica's process groups as `rank` (GPU `local_rank` of its node); returns the control group.
    `timeout_s` (EngineConfig.distributed_timeout_s) bounds every wait inside a step."""
    step_timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=layout.world_size,
                            timeout=START_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=step_timeout if rank == 0 else IDLE_TIMEOUT)
    cpu = dist.new_group(backend="gloo", timeout=START_TIMEOUT)
    device = dist.new_group(timeout=step_timeout)
    stage, tp_rank = layout.stage_of(rank), layout.tp_rank_of(rank)
    tp_group = None
    for s in range(layout.pp):  # every rank takes part in creating every group
        group = dist.new_group(layout.tp_group_ranks(s), timeout=step_timeout) if layout.tp > 1 else None
        if s == stage:
            tp_group = group
    pp = PipelineParallelState(
        rank=stage, size=layout.pp, layer_range=layout.layer_ranges[stage],
        prev_rank=layout.rank(stage - 1, tp_rank) if stage > 0 else None,
        next_rank=layout.rank(stage + 1, tp_rank) if stage < layout.pp - 1 else None,
        group=device)
    ep = ExpertParallelState(tp_rank, layout.tp) if layout.expert_parallel else ExpertParallelState()
    set_parallel_state(TensorParallelState(tp_rank, layout.tp, tp_group), pp,
                       WorldState(rank, layout.world_size, cpu), ep)
    return control


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    reset_parallel_state()
