"""Model-state memory of training: weights, gradients and optimizer states per GPU, and what
ZeRO partitions across data-parallel ranks or offloads to CPU.

Bytes per parameter follow Rajbhandari et al. 2020 ("ZeRO", §3.1): mixed-precision Adam keeps 2
bytes of 16-bit weights, 2 of 16-bit gradients and K = 12 of optimizer state (fp32 master weights,
momentum, variance). ZeRO stage 1 partitions the optimizer state over the N_d data-parallel ranks,
stage 2 also the gradients, stage 3 also the weights (their Figure 1: 16Ψ -> 4Ψ + 12Ψ/N_d ->
2Ψ + 14Ψ/N_d -> 16Ψ/N_d). ZeRO-3's temporary all-gather buffers are not counted, as in the paper.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.planning.spec import ModelSpec

PRECISIONS = ("mixed", "float32", "float16", "bfloat16")  # mixed: 16-bit weights and grads, fp32 master
OPTIMIZERS = ("adamw", "adamw8bit", "sgd")
OFFLOADS = ("none", "optimizer", "optimizer+params")
ZERO_STAGES = (0, 1, 2, 3)
# Optimizer states per parameter: AdamW momentum + variance; SGD momentum.
STATES = {"adamw": 2, "adamw8bit": 2, "sgd": 1}


def weight_bytes(precision: str) -> int:
    """Bytes of one weight (and one gradient): 16-bit unless training purely in float32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return 4 if precision == "float32" else 2


def optimizer_bytes_per_param(precision: str, optimizer: str) -> int:
    """K of the ZeRO paper: optimizer bytes per parameter.

    Each state is 1 byte for 8-bit AdamW (Dettmers et al. 2022; its fp32 absmax per 2048-value
    block, 0.2%, is not counted), else fp32 in mixed precision and the parameter's dtype in pure
    training (torch.optim keeps states like the parameter). Mixed precision adds the 4-byte fp32
    master copy. Mixed AdamW: 4 + 4 + 4 = 12.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    state = 1 if optimizer == "adamw8bit" else 4 if precision == "mixed" else weight_bytes(precision)
    master = 4 if precision == "mixed" else 0
    return master + STATES[optimizer] * state


@dataclass(frozen=True)
class ModelStates:
    weights: int
    gradients: int
    optimizer: int
    cpu: int  # what offloading moved to this GPU's share of CPU memory


def model_state_memory(
    spec: ModelSpec,
    *,
    precision: str = "mixed",
    optimizer: str = "adamw",
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    zero: int = 0,
    offload: str = "none",
) -> ModelStates:
    """Model states on the busiest GPU of a TP x PP x DP layout.

    torch.optim.AdamW also keeps a float32 `step` scalar per parameter tensor, counted with the
    optimizer state. Offload follows ZeRO-Offload (Ren et al. 2021, §4.1): the optimizer state and
    the gradients stream to CPU (which runs the optimizer step), so neither stays on the GPU; ZeRO-3
    parameter offload (ZeRO-Infinity) also moves the weight partition to CPU.
    """
    if zero not in ZERO_STAGES or offload not in OFFLOADS:
        raise ValueError(f"zero must be one of {ZERO_STAGES} and offload one of {OFFLOADS}")
    params, tensors = spec.params_per_gpu(tp, pp), spec.param_tensors_per_gpu(tp, pp)
    weights = gradients = params * weight_bytes(precision)
    opt = params * optimizer_bytes_per_param(precision, optimizer) + (4 * tensors if optimizer == "adamw" else 0)

    def partition(nbytes: int) -> int:
        return -(-nbytes // dp)

    if zero >= 1:
        opt = partition(opt)
    if zero >= 2:
        gradients = partition(gradients)
    if zero >= 3:
        weights = partition(weights)
    cpu = 0
    if offload != "none":
        cpu, opt, gradients = cpu + opt + gradients, 0, 0
    if offload == "optimizer+params":
        cpu, weights = cpu + weights, 0
    return ModelStates(weights=weights, gradients=gradients, optimizer=opt, cpu=cpu)
