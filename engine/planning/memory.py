"""Model-state memory of training: weights, gradients and optimizer states per GPU, and what
ZeRO partitions across data-parallel ranks or offloads to CPU.

Bytes per parameter follow Rajbhandari et al. 2020 ("ZeRO", §3.1): mixed-precision Adam keeps 2
bytes of 16-bit weights, 2 of 16-bit gradients and K = 12 of optimizer state (fp32 master weights,
momentum, variance). ZeRO stage 1 partitions the optimizer state over the N_d data-parallel ranks,
stage 2 also the gradients, stage 3 also the weights (their Figure 1: 16Ψ -> 4Ψ + 12Ψ/N_d ->
2Ψ + 14Ψ/N_d -> 16Ψ/N_d). ZeRO-3's temporary all-gather buffers are not counted, as in the paper.

`accounting="deepspeed"` counts what DeepSpeed's runtime holds instead, as its own estimators do
(deepspeed/runtime/zero/stage_1_and_2.py `estimate_zero2_model_states_mem_needs`, stage3.py
`estimate_zero3_model_states_mem_needs`, without offload: 2Ψ + 18Ψ/N_d and 4 x largest layer + 18Ψ/N_d):
an fp32 copy of each gradient partition (4Ψ/N_d more), and under ZeRO-3 the live parameters, the largest
module gathered in 16 bits with its 16-bit gradient (4 bytes per parameter of it; DeepSpeed's prefetch and
max_live_parameters buffers beyond that are not in its estimator, nor here). ZeRO-1 has no DeepSpeed
estimator; the same fp32 gradient partition is added to it (an extrapolation).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.planning.lora import LoraSpec, adapter_tensors, frozen_base_bytes
from engine.planning.spec import ModelSpec

PRECISIONS = ("mixed", "float32", "float16", "bfloat16")  # mixed: 16-bit weights and grads, fp32 master
# adamw32bit: float32 states whatever the weights' dtype (bitsandbytes' AdamW32bit and paged_adamw_32bit, QLoRA's)
OPTIMIZERS = ("adamw", "adamw8bit", "adamw32bit", "sgd")
OFFLOADS = ("none", "optimizer", "optimizer+params")
ZERO_STAGES = (0, 1, 2, 3)
ZERO_ACCOUNTING = ("paper", "deepspeed")
# Optimizer states per parameter: AdamW momentum + variance; SGD momentum.
STATES = {"adamw": 2, "adamw8bit": 2, "adamw32bit": 2, "sgd": 1}


def weight_bytes(precision: str) -> int:
    """Bytes of one weight (and one gradient): 16-bit unless training purely in float32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return 4 if precision == "float32" else 2


def optimizer_bytes_per_param(precision: str, optimizer: str) -> int:
    """K of the ZeRO paper: optimizer bytes per parameter.

    Each state is 1 byte for 8-bit AdamW (Dettmers et al. 2022; its fp32 absmax per 2048-value
    block, 0.2%, is not counted), 4 for bitsandbytes' 32-bit AdamW whatever the parameter's dtype, else
    fp32 in mixed precision and the parameter's dtype in pure training (torch.optim keeps states like
    the parameter). Mixed precision adds the 4-byte fp32
    master copy. Mixed AdamW: 4 + 4 + 4 = 12.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    state = {"adamw8bit": 1, "adamw32bit": 4}.get(optimizer, 4 if precision == "mixed" else weight_bytes(precision))
    master = 4 if precision == "mixed" else 0
    return master + STATES[optimizer] * state


@dataclass(frozen=True)
class ModelStates:
    weights: int
    gradients: int
    optimizer: int
    cpu: int  # what offloading moved to this GPU's share of CPU memory
    frozen: int = 0  # of `weights`: the frozen base of LoRA training, at its storage precision


def model_state_memory(
    spec: ModelSpec,
    *,
    precision: str = "mixed",
    optimizer: str = "adamw",
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    ep: int = 1,
    zero: int = 0,
    offload: str = "none",
    accounting: str = "paper",
    lora: LoraSpec | None = None,
) -> ModelStates:
    """Model states on the busiest GPU of a TP x PP x DP layout, every expert of an MoE model included.

    torch.optim.AdamW also keeps a float32 `step` scalar per parameter tensor, counted with the
    optimizer state. Offload follows ZeRO-Offload (Ren et al. 2021, §4.1): the optimizer state and
    the gradients stream to CPU (which runs the optimizer step), so neither stays on the GPU; ZeRO-3
    parameter offload (ZeRO-Infinity) also moves the weight partition to CPU.

    Expert parallelism (`ep`, carved out of the DP ranks as in Megatron-LM and DeepSpeed-MoE) gives each
    of ep ranks experts / ep of the experts (each still split over TP); the dense part follows TP / DP.
    ZeRO then partitions the dense states over the dp ranks and the expert states over the dp / ep ranks
    that hold the same experts (DeepSpeed's expert-data-parallel group, `deepspeed.utils.groups`).

    With `lora` only the adapters train (lora.py): their weights, gradients and optimizer states follow the
    rules above (mixed precision: 2 + 2 + 12 bytes, the 16 bytes PEFT's float32 adapters under autocast also
    take as 4 + 4 + 8), and the frozen base adds its storage to the weights, partitioned by ZeRO-3 and
    offloaded with the parameters like any weight; no gradient or optimizer state of it exists.
    """
    if zero not in ZERO_STAGES or offload not in OFFLOADS or accounting not in ZERO_ACCOUNTING:
        raise ValueError(f"zero must be one of {ZERO_STAGES}, offload one of {OFFLOADS}, accounting one of "
                         f"{ZERO_ACCOUNTING}")
    if dp % ep:
        raise ValueError(f"the expert-parallel size {ep} must divide the data-parallel size {dp}")
    if lora is not None and accounting == "deepspeed":
        raise ValueError("DeepSpeed's estimators count full fine-tuning: with LoRA use the paper's accounting")
    if lora is None:
        stage = spec.stage_params(tp, pp, expert_shards=ep * tp)
        groups = [  # (elements, tensors, ranks that share them for ZeRO)
            (stage.elements - stage.expert_elements, stage.tensors - stage.expert_tensors, dp),
            (stage.expert_elements, stage.expert_tensors, dp // ep),
        ]
        frozen = 0
    else:
        adapters = spec.extra_tensors_per_gpu(adapter_tensors(spec, lora), tp, pp)
        groups = [(adapters.elements, adapters.tensors, dp)]
        shards = (dp, dp // ep) if zero >= 3 else (1, 1)
        frozen = frozen_base_bytes(spec, lora, weight_bytes(precision), tp, pp, ep * tp, *shards)
    weights = gradients = opt = cpu = 0
    for params, tensors, ranks in groups:
        w = g = params * weight_bytes(precision)
        o = params * optimizer_bytes_per_param(precision, optimizer) + (4 * tensors if optimizer == "adamw" else 0)

        def partition(nbytes: int, ranks: int = ranks) -> int:
            return -(-nbytes // ranks)

        if zero >= 1:
            o = partition(o)
        if zero >= 2:
            g = partition(g)
        if zero >= 3:
            w = partition(w)
        if accounting == "deepspeed" and zero >= 1:
            # ZeRO-3 keeps no 16-bit gradient partition: the fp32 one replaces it (DeepSpeed's 18 = 2 + 4 + 12)
            g = (0 if zero == 3 else g) + partition(params * 4)
        weights, gradients, opt = weights + w, gradients + g, opt + o
    weights += frozen
    if offload != "none":
        cpu, opt, gradients = cpu + opt + gradients, 0, 0
    if offload == "optimizer+params":
        cpu, weights = cpu + weights, 0
    if accounting == "deepspeed" and zero == 3:  # the gathered module and its gradient stay on the GPU
        live = spec.largest_module_params(tp, expert_shards=ep * tp) * weight_bytes(precision)
        weights, gradients = weights + live, gradients + live
    return ModelStates(weights=weights, gradients=gradients, optimizer=opt, cpu=cpu,
                       frozen=0 if offload == "optimizer+params" else frozen)
