"""Training time: end to end from a published or measured rate, or predicted from the hardware.

A published or measured figure (`--achieved-tflops`, `--mfu`, `--time-per-step`) is end to end: the
pipeline bubble and the communication are already in it, so nothing is added (Narayanan et al. 2021
compute their Table 2 training times as 8TP / nX from the achieved X alone, eq. 4).

A prediction from the hardware adds them up for one optimizer step on the busiest GPU:
  compute   FLOPs per GPU / (peak x compute efficiency)
  + the communication that is not hidden (comm.py: each collective's bytes over the slowest link it
    crosses; TP, PP and EP transfers sit on the critical path; the DP gradient sync runs behind the
    backward pass for a stated fraction of its time, never for longer than the backward it hides behind)
  + the pipeline bubble, (p - 1) / m of the time one pipeline pass of compute and TP / EP traffic takes
    (Narayanan et al. 2021, §2.2.1).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.planning.comm import Collective

# Large bf16 GEMMs reach 70-80% of dense peak on A100 / H100 (cuBLAS); whole layers (norms, softmax,
# rotary, small matmuls) less. 0.7 is this estimator's default, not a published constant: --compute-efficiency.
DEFAULT_COMPUTE_EFFICIENCY = 0.7
# Share of the DP gradient sync that overlaps the backward pass: buckets are all-reduced as soon as their
# gradients are ready (PyTorch DDP, Li et al. 2020, §3.2.3), but the last bucket's cannot be. --dp-overlap.
DEFAULT_DP_OVERLAP = 0.5
BACKWARD_SHARE = 2 / 3  # of a training step's FLOPs: backward is twice the forward (Kaplan et al. 2020)


@dataclass(frozen=True)
class Throughput:
    """How fast a GPU computes and talks. `achieved` (or peak x mfu) is FLOP/s on the FLOPs counted,
    recomputation included (mfu: on the model FLOPs); `time_per_step` is a measured step time. With only
    `peak` and the link bandwidths (bytes/s per GPU per direction) the step time is predicted."""

    achieved: float | None = None
    peak: float | None = None
    mfu: float | None = None
    time_per_step: float | None = None
    intra_node_bw: float | None = None
    inter_node_bw: float | None = None
    compute_efficiency: float = DEFAULT_COMPUTE_EFFICIENCY
    dp_overlap: float = DEFAULT_DP_OVERLAP


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on the busiest GPU, and where they go."""

    compute: float
    communication: dict[str, float]  # each collective's full time
    exposed_communication: float
    bubble: float
    total: float
    end_to_end: bool  # from a published / measured rate: nothing was added to it


def pipeline_bubble(pp: int, num_micro_batches: int) -> float:
    """Idle fraction of a 1F1B pipeline step: (p - 1) / m (Narayanan et al. 2021, §2.2.1)."""
    return (pp - 1) / num_micro_batches


class MissingBandwidth(ValueError):
    def __init__(self, setting: str, collective: str) -> None:
        super().__init__(f"needed for the {collective}: give --gpu or --{setting.replace('_', '-')}")
        self.setting, self.collective = setting, collective


def collective_seconds(c: Collective, t: Throughput) -> float:
    bandwidth = t.inter_node_bw if c.crosses_nodes else t.intra_node_bw
    if bandwidth is None:
        raise MissingBandwidth("inter_node_gbps" if c.crosses_nodes else "intra_node_gbps", c.name)
    return c.bytes_sent / bandwidth


def step_time(flops_per_gpu: float, model_flops_per_gpu: float, collectives: list[Collective], t: Throughput,
              *, pp: int, micro_batches: int) -> StepTime | None:
    """One optimizer step; None when neither a rate nor a peak is known."""
    if t.time_per_step is not None:
        return StepTime(t.time_per_step, {}, 0.0, 0.0, t.time_per_step, True)
    if t.achieved is not None or t.mfu is not None:
        compute = (flops_per_gpu / t.achieved if t.achieved is not None
                   else model_flops_per_gpu / (t.peak * t.mfu))  # MFU is defined on model FLOPs (PaLM, App. B)
        return StepTime(compute, {}, 0.0, 0.0, compute, True)
    if t.peak is None:
        return None
    compute = flops_per_gpu / (t.peak * t.compute_efficiency)
    seconds = {c.name: collective_seconds(c, t) for c in collectives}
    critical = sum(seconds[c.name] for c in collectives if not c.overlapped)
    synced = sum(seconds[c.name] for c in collectives if c.overlapped)
    # ZeRO-0/1 sync once, behind the last micro-batch's backward; ZeRO-2/3 traffic recurs every micro-batch
    every = any(c.every_micro_batch for c in collectives if c.overlapped)
    backward = BACKWARD_SHARE * compute / (1 if every else micro_batches)
    exposed_sync = synced - min(t.dp_overlap * synced, backward)
    pass_time = compute + sum(seconds[c.name] for c in collectives if not c.overlapped and c.kind != "pp")
    bubble = pipeline_bubble(pp, micro_batches) * pass_time
    exposed = critical + exposed_sync
    return StepTime(compute, seconds, exposed, bubble, compute + exposed + bubble, False)
