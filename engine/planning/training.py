"""A training plan: global batch, steps, FLOPs and time, and memory per GPU for one layout."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from engine.planning.activations import activation_memory
from engine.planning.flops import training_flops
from engine.planning.layout import Layout, PlanError, check_positive
from engine.planning.memory import model_state_memory, weight_bytes
from engine.planning.spec import ModelSpec


def train_steps(global_batch: int, seq_len: int, *, tokens: int | None = None, samples: int | None = None,
                epochs: int | None = None) -> tuple[int, int]:
    """(optimizer steps, tokens trained on). From a token count: ceil(tokens / (global batch x seq_len)).
    From a data set: epochs x ceil(samples / global batch), the last batch of an epoch partial."""
    check_positive(tokens=tokens, samples=samples, epochs=epochs)
    if (tokens is None) == (samples is None):
        raise PlanError("tokens", "give the training length as either --tokens or --samples (with --epochs)")
    if tokens is not None:
        if epochs is not None:
            raise PlanError("epochs", "counts passes over --samples; --tokens is already the total")
        return math.ceil(tokens / (global_batch * seq_len)), tokens
    epochs = epochs or 1
    return epochs * math.ceil(samples / global_batch), epochs * samples * seq_len


@dataclass(frozen=True)
class Throughput:
    """How fast a GPU runs. `achieved` (or peak x mfu) is FLOP/s on the FLOPs counted, recomputation
    included; `time_per_step` is a measured step time that replaces the FLOPs-based estimate."""

    achieved: float | None = None
    peak: float | None = None
    mfu: float | None = None
    time_per_step: float | None = None

    def rate(self) -> float | None:
        if self.achieved is not None:
            return self.achieved
        return self.peak * self.mfu if self.peak is not None and self.mfu is not None else None


def pipeline_bubble(pp: int, num_micro_batches: int) -> float:
    """Idle fraction of a 1F1B pipeline step: (p - 1) / m (Narayanan et al. 2021, §2.2.1)."""
    return (pp - 1) / num_micro_batches


@dataclass(frozen=True)
class MemoryBreakdown:
    weights: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations


@dataclass(frozen=True)
class TrainPlan:
    layout: Layout
    params: int
    global_batch: int
    steps: int
    tokens: int
    flops: float  # executed, recomputation included
    model_flops: float  # without recomputation
    time_s: float | None
    mfu: float | None  # from a measured step time and a peak only
    memory_per_gpu: MemoryBreakdown
    activations_per_layer: int
    cpu_memory: int  # per node: what offloading moved off its GPUs
    fits: bool | None  # None when no GPU memory size was given

    def to_json(self) -> dict:
        memory = asdict(self.memory_per_gpu) | {"total": self.memory_per_gpu.total}
        layout = asdict(self.layout) | {"gpus": self.layout.gpus, "dp": self.layout.dp}
        return {k: v for k, v in asdict(self).items() if k not in ("layout", "memory_per_gpu")} | {
            "layout": layout, "memory_per_gpu": memory,
        }


def plan_training(
    spec: ModelSpec,
    layout: Layout,
    *,
    seq_len: int,
    precision: str = "mixed",
    optimizer: str = "adamw",
    attention: str = "flash",
    tokens: int | None = None,
    samples: int | None = None,
    epochs: int | None = None,
    flops_method: str = "nd",
    throughput: Throughput = Throughput(),
    gpu_memory_bytes: int | None = None,
) -> TrainPlan:
    layout.check(spec)
    check_positive(seq_len=seq_len, gpu_memory=gpu_memory_bytes)
    steps, trained_tokens = train_steps(layout.global_batch, seq_len, tokens=tokens, samples=samples, epochs=epochs)
    flops, model_flops = training_flops(spec, seq_len, trained_tokens, flops_method, layout.recompute)
    time_s = mfu = None
    if throughput.time_per_step is not None:
        time_s = steps * throughput.time_per_step
        if throughput.peak is not None:  # MFU: model FLOPs per second over peak (PaLM, Appendix B)
            mfu = model_flops / (time_s * layout.gpus * throughput.peak)
    elif throughput.rate() is not None:
        time_s = flops / (layout.gpus * throughput.rate()) * (1 + pipeline_bubble(layout.pp, layout.grad_accum))
    states = model_state_memory(
        spec, precision=precision, optimizer=optimizer, tp=layout.tp, pp=layout.pp, dp=layout.dp,
        zero=layout.zero, offload=layout.offload,
    )
    acts = activation_memory(
        spec, seq_len, layout.micro_batch, weight_bytes(precision), attention=attention, tp=layout.tp,
        sequence_parallel=layout.sequence_parallel, recompute=layout.recompute, pp=layout.pp,
        num_micro_batches=layout.grad_accum,
    )
    memory = MemoryBreakdown(states.weights, states.gradients, states.optimizer, acts.total)
    return TrainPlan(
        layout=layout, params=spec.params, global_batch=layout.global_batch, steps=steps, tokens=trained_tokens,
        flops=flops, model_flops=model_flops, time_s=time_s, mfu=mfu, memory_per_gpu=memory,
        activations_per_layer=acts.per_layer, cpu_memory=states.cpu * layout.gpus_per_node,
        fits=None if gpu_memory_bytes is None else memory.total <= gpu_memory_bytes,
    )
