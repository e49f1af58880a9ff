"""A training plan: global batch, steps, FLOPs and time, and memory per GPU for one layout."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from engine.planning.activations import activation_memory
from engine.planning.comm import training_collectives
from engine.planning.flops import training_flops
from engine.planning.layout import Layout, PlanError, check_positive
from engine.planning.lora import LoraSpec, adapter_params, unmatched_targets
from engine.planning.memory import model_state_memory, weight_bytes
from engine.planning.spec import ModelSpec
from engine.planning.steptime import MissingBandwidth, StepTime, Throughput, pipeline_bubble, step_time

__all__ = ["MemoryBreakdown", "TrainPlan", "Throughput", "pipeline_bubble", "plan_training", "train_steps"]
CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022, Table 3: compute-optimal tokens ~ 20 x parameters


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
    active_params: int  # per token: all of a dense model; an MoE model's top-k experts, not the others
    global_batch: int
    steps: int
    tokens: int
    flops: float  # executed, recomputation included
    model_flops: float  # without recomputation
    time_s: float | None
    mfu: float | None  # model FLOPs per second over peak (needs a peak)
    hfu: float | None  # executed FLOPs (recomputation included) per second over peak
    memory_per_gpu: MemoryBreakdown
    activations_per_layer: int
    cpu_memory: int  # per node: what offloading moved off its GPUs
    ep_all_to_all_bytes: float  # sent per GPU per optimizer step by the expert all-to-alls (0 without EP)
    micro_steps: int  # forward + backward passes of each GPU: steps x micro-batches per step
    tokens_per_step: int
    communication: list[dict]  # per GPU per optimizer step: name, bytes, ranks, crosses_nodes, seconds, formula
    step: StepTime | None
    gpu_hours: float | None
    cost: float | None
    chinchilla_tokens: int  # compute-optimal token count for the parameters (a hint, dense models)
    fits: bool | None  # None when no GPU memory size was given
    trainable_params: int = 0  # all parameters; with LoRA the adapters' (PEFT's trainable parameter count)
    lora: dict | None = None  # the LoRA setup, the frozen base's storage and its bytes on the busiest GPU

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
    price_per_gpu_hour: float | None = None,
    zero_accounting: str = "paper",
    lora: LoraSpec | None = None,
) -> TrainPlan:
    """Full fine-tuning, or with `lora` LoRA / QLoRA: the adapters train, the base stays frozen (lora.py)."""
    layout.check(spec)
    check_positive(seq_len=seq_len, gpu_memory=gpu_memory_bytes)
    trainable = spec.params if lora is None else adapter_params(spec, lora)
    if lora is not None:
        _check_lora(spec, lora, zero_accounting)
        lora = replace(lora, copies_input=precision == "mixed")  # PEFT's float32 adapters under autocast
    steps, trained_tokens = train_steps(layout.global_batch, seq_len, tokens=tokens, samples=samples, epochs=epochs)
    flops, model_flops = training_flops(spec, seq_len, trained_tokens, flops_method, layout.recompute,
                                        None if lora is None else trainable)
    act_bytes = weight_bytes(precision)
    collectives = training_collectives(spec, layout, seq_len, act_bytes, lora)
    per_gpu_step = layout.gpus * steps
    try:
        step = step_time(flops / per_gpu_step, model_flops / per_gpu_step, collectives, throughput, pp=layout.pp,
                         micro_batches=layout.grad_accum)
    except MissingBandwidth as e:
        raise PlanError(e.setting, str(e)) from None
    time_s = mfu = hfu = None
    if step is not None:
        time_s = steps * step.total
        if throughput.peak is not None:  # MFU: model FLOPs per second over peak (PaLM, Appendix B)
            mfu = model_flops / (time_s * layout.gpus * throughput.peak)
            hfu = flops / (time_s * layout.gpus * throughput.peak)
    gpu_hours = None if time_s is None else time_s * layout.gpus / 3600
    states = model_state_memory(
        spec, precision=precision, optimizer=optimizer, tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep,
        zero=layout.zero, offload=layout.offload, accounting=zero_accounting, lora=lora,
    )
    acts = activation_memory(
        spec, seq_len, layout.micro_batch, act_bytes, attention=attention, tp=layout.tp,
        sequence_parallel=layout.sequence_parallel, recompute=layout.recompute, pp=layout.pp,
        num_micro_batches=layout.grad_accum, lora=lora,
    )
    memory = MemoryBreakdown(states.weights, states.gradients, states.optimizer, acts.total)
    seconds = {} if step is None else step.communication
    communication = [{"name": c.name, "bytes": c.bytes_sent, "ranks": c.ranks, "crosses_nodes": c.crosses_nodes,
                      "seconds": seconds.get(c.name), "overlapped": c.overlapped, "formula": c.formula}
                     for c in collectives]
    return TrainPlan(
        layout=layout, params=spec.params, active_params=spec.active_params, global_batch=layout.global_batch,
        steps=steps, tokens=trained_tokens,
        flops=flops, model_flops=model_flops, time_s=time_s, mfu=mfu, memory_per_gpu=memory,
        activations_per_layer=acts.per_layer, cpu_memory=states.cpu * layout.gpus_per_node,
        ep_all_to_all_bytes=sum(c.bytes_sent for c in collectives if c.kind == "ep"),
        micro_steps=steps * layout.grad_accum, tokens_per_step=layout.global_batch * seq_len,
        communication=communication, step=step, hfu=hfu, gpu_hours=gpu_hours,
        cost=None if gpu_hours is None or price_per_gpu_hour is None else gpu_hours * price_per_gpu_hour,
        chinchilla_tokens=CHINCHILLA_TOKENS_PER_PARAM * spec.params,
        fits=None if gpu_memory_bytes is None else memory.total <= gpu_memory_bytes,
        trainable_params=trainable,
        lora=None if lora is None else asdict(lora) | {
            "scaling": lora.scaling, "base_storage": lora.base_storage, "frozen_weights_per_gpu": states.frozen},
    )


def _check_lora(spec: ModelSpec, lora: LoraSpec, zero_accounting: str) -> None:
    missing = unmatched_targets(spec, lora)
    if missing:
        mlp = "its MLPs are routed experts, which LoRA does not adapt here" if spec.is_moe else (
            "a GELU MLP has up (fc) and down only")
        raise PlanError("lora_targets", f"{', '.join(missing)} names no projection of {spec.name}: {mlp}")
    if zero_accounting == "deepspeed":
        raise PlanError("zero_accounting", "DeepSpeed's estimators count full fine-tuning: with LoRA, use paper")
