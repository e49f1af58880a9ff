"""The ranks other than 0: follow rank 0's steps.

A follower builds its shard of the model (its stage's layers, its TP slice of each) and its share
of the KV cache with the same ModelRunner as rank 0, then loops: wait for rank 0's next message
on the control group, run each micro-batch through `execute_model` (which applies the step's
stream updates and block copies), and, on the last stage's TP rank 0 under pipeline parallelism,
send the sampled tokens to rank 0. Any error ends the process; rank 0 sees the closed connections
or the exit at once.
"""

from __future__ import annotations

import logging
import time

import torch.distributed as dist

from engine.distributed import pipeline
from engine.distributed.groups import destroy_distributed, init_distributed
from engine.distributed.layout import ParallelLayout
from engine.distributed.state import pp_state, tp_state
from engine.executor.step import REPORT, STOP, StepMessage
from engine.layers.linear import resident_bytes, storage_bytes
from engine.layers.moe import packed_expert_bytes

logger = logging.getLogger(__name__)


def worker_main(rank: int, layout: ParallelLayout, config, init_method: str, local_rank: int) -> None:
    """A follower process: join the replica, build this rank's shard, follow until told to stop."""
    from engine.loading.loader import source_for
    from engine.runner.model_runner import ModelRunner, resolve_device

    source = source_for(config)
    control = init_distributed(layout, rank, resolve_device(config.device), init_method, local_rank,
                               config.distributed_timeout_s)
    runner = ModelRunner(config, source)
    logger.info("rank %d ready: stage %d (layers %s), TP rank %d of %d", rank, pp_state().rank,
                pp_state().layer_range, tp_state().rank, tp_state().size)
    follow(runner, layout, control)
    destroy_distributed()


def follow(runner, layout: ParallelLayout, control) -> None:
    sends_output = layout.pp > 1 and dist.get_rank() == layout.last_stage_leader
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        msg: StepMessage = box[0]
        if msg.kind == STOP:
            return
        if msg.kind == REPORT:
            dist.gather_object(rank_report(runner), None, dst=0, group=control)
            continue
        run_step(runner, msg, sends_output)


def run_step(runner, msg: StepMessage, sends_output: bool) -> list:
    """This rank's share of one step; returns each micro-batch's ModelRunnerOutput (None where
    this rank does not sample)."""
    start = time.perf_counter()
    outs = []
    for batch in msg.micro_batches:
        with pipeline.clock.compute(runner.device):
            out = runner.execute_model(batch)
        if sends_output:
            pipeline.send_output(out, dst=0)
        outs.append(out)
    pipeline.wait_sends()
    pipeline.clock.steps += 1
    pipeline.clock.step_s += time.perf_counter() - start
    return outs


def rank_report(runner) -> dict:
    """This rank's memory, measured from its tensors, and where its step time went."""
    c = pipeline.clock
    return {
        "rank": dist.get_rank(), "stage": pp_state().rank, "tp_rank": tp_state().rank,
        "layer_range": pp_state().layer_range, "num_layers": len(list(runner.model.layers())),
        "param_bytes": resident_bytes(runner.model) + packed_expert_bytes(runner.model),
        "kv_cache_bytes": storage_bytes(runner.kv_caches), "num_blocks": runner.num_blocks,
        "steps": c.steps, "step_s": c.step_s, "compute_s": c.compute_s, "recv_wait_s": c.recv_wait_s,
        "busy_s": c.busy_s,
    }
