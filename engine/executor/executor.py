"""Rank 0 of a TP x PP replica: what EngineCore steps instead of a local ModelRunner.

Rank 0 keeps the scheduler and the KV block accounting; it is also stage 0's TP rank 0 and
computes its own share. Each step it splits the scheduler's plain output into micro-batches
(pipeline_micro_batches of them, by default one per pipeline stage), broadcasts them to every
rank on the control group, runs stage 0 on each micro-batch in turn (its sends do not wait), and,
with pipeline stages, then receives each micro-batch's sampled tokens from the last stage's TP
rank 0, which samples. Followers run the same ModelRunner on the same inputs
(engine.executor.worker), so every rank builds identical batch tensors and block tables.

On one node rank 0 starts the other ranks itself (engine.executor.procs); under torchrun they
are started by torchrun (`python -m engine.torchrun`) and rank 0 only joins them.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

from engine.distributed import pipeline
from engine.distributed.groups import destroy_distributed, init_distributed
from engine.distributed.layout import ParallelLayout, check_layout, launched_by_torchrun
from engine.distributed.state import reset_parallel_state, world_state
from engine.executor.procs import ChildProcesses, WorkerDiedError
from engine.executor.step import REPORT, STEP, STOP, StepMessage, split_micro_batches
from engine.executor.worker import rank_report, worker_main
from engine.runner.model_runner import ModelRunner, resolve_device
from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


def make_executor(config, source):
    """A local ModelRunner for one process, else rank 0's ParallelExecutor."""
    if config.data_parallel_size > 1:
        raise ValueError("EngineCore runs one replica; data_parallel_size > 1 needs LLM(...) or `engine serve`, "
                         "which start the replicas (engine.frontend.data_parallel)")
    if world_state().size > 1:  # layers read the process-wide parallel state as they are built
        raise RuntimeError("a tensor/pipeline-parallel engine is already running in this process: shut it down "
                           "(LLM.shutdown(), or leave its `with` block) before starting another engine")
    layout = check_layout(config, source.hf_config)
    if layout.world_size == 1 and not launched_by_torchrun():
        return ModelRunner(config, source)
    return ParallelExecutor(config, source, layout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ParallelExecutor:
    def __init__(self, config, source, layout: ParallelLayout):
        self.layout = layout
        self.children: ChildProcesses | None = None
        self._dead: str | None = None
        self._closed = False
        self.timeout_s = config.distributed_timeout_s
        # One micro-batch per stage unless the config says otherwise; 1 turns the overlap off.
        self.num_micro_batches = (config.pipeline_micro_batches or layout.pp) if layout.pp > 1 else 1
        if launched_by_torchrun():
            if int(os.environ["RANK"]) != 0:
                raise RuntimeError("under torchrun, ranks other than 0 run `python -m engine.torchrun`")
            init_method, local_rank = "env://", int(os.environ["LOCAL_RANK"])
        else:
            init_method, local_rank = f"tcp://127.0.0.1:{_free_port()}", 0
            self.children = ChildProcesses()
            for rank in range(1, layout.world_size):
                self.children.start(f"pagewise-rank{rank}", worker_main, rank, layout, config, init_method, rank)
        try:
            self.control = init_distributed(layout, 0, resolve_device(config.device), init_method, local_rank,
                                            self.timeout_s)
            pipeline.reset()
            self.runner = ModelRunner(config, source)
        except BaseException as e:
            culprit = self.children.failure(wait_s=2.0) if self.children and isinstance(e, RuntimeError) else None
            self._dead = f"start-up failed: {e}"
            self.shutdown()
            if culprit:
                raise WorkerDiedError(f"a worker failed while starting: {culprit}") from e
            raise
        atexit.register(self.shutdown)
        logger.info("parallel engine: %d ranks (tensor_parallel_size %d x pipeline_parallel_size %d), layers per "
                    "stage %s, %d micro-batches per step", layout.world_size, layout.tp, layout.pp,
                    [b - a for a, b in layout.layer_ranges], self.num_micro_batches)

    # ---- the ModelRunner face EngineCore uses ----------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def max_model_len(self) -> int:
        return self.runner.max_model_len

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.runner.kv_dtype

    def kv_bytes_per_token(self) -> int:
        return self.runner.kv_bytes_per_token()

    def execute_model(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        self.check_health()
        start = time.perf_counter()
        micro = split_micro_batches(batch, self.num_micro_batches)
        try:
            self._broadcast(StepMessage(STEP, micro))
            outs = []
            for mb in micro:
                with pipeline.clock.compute(self.runner.device):
                    outs.append(self.runner.execute_model(mb))
            if self.layout.pp > 1:  # the last stage sampled; rank 0 only ran stage 0
                outs = [pipeline.recv_output(src=self.layout.last_stage_leader) for _ in micro]
            pipeline.wait_sends()
        except RuntimeError as e:  # torch.distributed errors (DistBackendError included)
            raise self._failed(e) from e
        pipeline.clock.steps += 1
        pipeline.clock.step_s += time.perf_counter() - start
        merged = ModelRunnerOutput()
        for out in outs:  # micro-batches are contiguous: rows come back in scheduling order
            merged.extend(out)
        return merged

    # ---- health, reports, shutdown ---------------------------------------------------------

    def check_health(self) -> None:
        if self._dead is None and self.children is not None and self.children.failure():
            self._dead = f"tensor/pipeline-parallel worker {self.children.failure()}"
        if self._dead is not None:
            raise WorkerDiedError(self._dead)

    def _failed(self, error: BaseException) -> WorkerDiedError:
        # A dead peer closes its sockets a moment before its exit is reaped: give the monitor
        # that moment, so the error names the process rather than a socket.
        culprit = self.children.failure(wait_s=2.0) if self.children is not None else None
        self._dead = (f"tensor/pipeline-parallel worker {culprit}" if culprit else
                      "a collective with the other ranks failed (a rank died, or hung past "
                      f"distributed_timeout_s={self.timeout_s:g}s): {error}")
        logger.error("%s", self._dead)
        return WorkerDiedError(self._dead)

    def rank_reports(self) -> list[dict]:
        """Every rank's measured memory and step timing (engine.executor.worker.rank_report), by rank."""
        self.check_health()
        reports = [None] * self.layout.world_size
        try:
            self._broadcast(StepMessage(REPORT))
            dist.gather_object(rank_report(self.runner), reports, dst=0, group=self.control)
        except RuntimeError as e:
            raise self._failed(e) from e
        return reports

    def _broadcast(self, msg: StepMessage) -> None:
        dist.broadcast_object_list([msg], src=0, group=self.control)

    def shutdown(self) -> None:
        """Tell the other ranks to leave, make sure they have, and leave the process groups."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        stopped = True
        if self._dead is None and dist.is_initialized():
            # On its own thread: a follower that hangs must not hang shutdown with it.
            sender = threading.Thread(target=self._broadcast, args=(StepMessage(STOP),), daemon=True)
            sender.start()
            sender.join(5.0)
            stopped = not sender.is_alive()
        if self.children is not None:
            # After a failure the survivors may wait on a collective forever: cut them loose at once.
            self.children.stop(timeout=10.0 if stopped and self._dead is None else 0.0)
        if stopped:
            destroy_distributed()
        else:
            logger.warning("a rank did not take the stop message; its process group is left as is")
            reset_parallel_state()


def pipeline_bubble(reports: list[dict], pp: int) -> float:
    """The fraction of the steps' wall time (on rank 0) that the stages sat idle, measured: one
    minus the stages' summed busy time (compute minus waiting for activations, on each stage's
    TP rank 0) over pp x rank 0's step time."""
    leaders = [r for r in reports if r["tp_rank"] == 0]
    wall = reports[0]["step_s"]
    return 1.0 - sum(r["busy_s"] for r in leaders) / (pp * wall) if wall else 0.0
