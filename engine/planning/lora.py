"""LoRA and QLoRA: the adapters (the only parameters trained) and the frozen base at its storage precision.

LoRA (Hu et al. 2021, §4.1) adds to a targeted projection W [out, in] the product B A, A [r, in] and
B [out, r], scaled by alpha / r: r (in + out) trainable parameters per projection per layer, as PEFT's
LoraConfig counts them. The targets are q, k, v, o and the MLP's gate, up and down, in a dense MLP or an MoE
layer's shared expert; routed experts are not adapted. GPT-2's fused c_attn is adapted per slice (q, k, v
each), as loralib's MergedLinear and vLLM do, rather than as one matrix.

Tensor parallelism splits an adapter as it splits its projection (Megatron-LM / NeMo, vLLM): a
column-parallel projection's A is whole on every rank and B split by output; a row-parallel one's (o, down)
A split by input and B whole.

QLoRA (Dettmers et al. 2023, §3) stores the frozen linear layers in 4-bit NormalFloat in blocks of 64 weights,
each with a float32 absmax: 4 + 32/64 = 4.5 bits a weight. Double quantization stores those absmax in 8 bits
with a float32 constant per 256 of them: 4 + 8/64 + 32/(64 x 256) = 4.127 bits. LLM.int8() (bitsandbytes'
Linear8bitLt) keeps a byte a weight and a float32 scale per output row. As bitsandbytes does under
transformers, only linear layers are quantized: embeddings, the LM head, norms, the router and the routed
experts stay at the training dtype. Per-tensor constants (the code tables, the mean subtracted before double
quantization) are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.planning.spec import ModelSpec, ParamTensor, Projection
from engine.planning.weight_formats import WeightFormat

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
BASE_QUANTIZATIONS = ("none", "int8", "nf4")
MAX_LORA_RANK = 16  # vLLM's default --max-lora-rank: the rank serving's adapter slots are sized for


@dataclass(frozen=True)
class NF4Format(WeightFormat):
    """bitsandbytes' NF4 storage, exact for any size: two codes a byte, an absmax per 64 weights (float32, or
    with double quantization a byte, plus a float32 constant per 256 absmax)."""

    double_quant: bool = False

    def bytes(self, elements: int) -> int:
        blocks = -(-elements // 64)
        absmax = blocks + 4 * -(-blocks // 256) if self.double_quant else 4 * blocks
        return -(-elements // 2) + absmax


NF4 = NF4Format("NF4", 64, 32 + 4)  # per block of 64: 32 bytes of 4-bit codes + a float32 absmax
NF4_DOUBLE_QUANT = NF4Format("NF4 + double quantization", 64 * 256, 256 * (32 + 1) + 4, double_quant=True)


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA setup in PEFT's LoraConfig vocabulary, with the base's storage (QLoRA: nf4)."""

    r: int
    target_modules: tuple[str, ...] = ("q", "v")  # PEFT's default for Llama-family models
    lora_alpha: float = 8.0  # PEFT's default; the scale alpha / r changes no memory
    lora_dropout: float = 0.0  # PEFT's default; above 0 each targeted projection keeps a dropped copy of its input
    base_quantization: str = "none"  # "none": the frozen base at the training dtype
    double_quant: bool = True  # nf4's absmax in 8 bits (bnb_4bit_use_double_quant), as QLoRA trains
    # A reads a copy of its input even without dropout: PEFT's float32 adapters under 16-bit autocast (the
    # plan sets it for --dtype mixed), where autocast casts the float32 copy PEFT makes back to 16 bits
    copies_input: bool = False

    def __post_init__(self) -> None:
        if self.r <= 0 or not 0 <= self.lora_dropout < 1:
            raise ValueError(f"r must be positive and lora_dropout in [0, 1), got {self.r} and {self.lora_dropout}")
        if self.base_quantization not in BASE_QUANTIZATIONS or not set(self.target_modules) <= set(LORA_TARGETS):
            raise ValueError(f"base_quantization must be one of {BASE_QUANTIZATIONS} and target_modules among "
                             f"{LORA_TARGETS}")

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.r

    @property
    def base_format(self) -> WeightFormat | None:
        """The frozen linear layers' block format (None: the training dtype, or int8's per-row scale)."""
        if self.base_quantization != "nf4":
            return None
        return NF4_DOUBLE_QUANT if self.double_quant else NF4

    @property
    def base_storage(self) -> str:
        """How the frozen linear layers are stored, in words, for the report."""
        if self.base_format is not None:
            return f"{self.base_format.name} ({self.base_format.bits_per_weight:.3f} bits a weight)"
        return {"int8": "int8 (LLM.int8: a byte a weight + a float32 scale per row)"}.get(self.base_quantization,
                                                                                         "the training dtype")


def targeted_projections(spec: ModelSpec, lora: LoraSpec) -> list[Projection]:
    return [p for p in spec.projections() if p.target in lora.target_modules]


def unmatched_targets(spec: ModelSpec, lora: LoraSpec) -> list[str]:
    """Targets that name no projection of the model (gate in a GELU MLP; the MLP's of an all-MoE model)."""
    found = {p.target for p in spec.projections()}
    return [t for t in lora.target_modules if t not in found]


def adapter_tensors(spec: ModelSpec, lora: LoraSpec) -> list[ParamTensor]:
    """A and B of every targeted projection of one layer, split over TP as their projection is."""
    out = []
    for p in targeted_projections(spec, lora):
        out.append(ParamTensor(f"{p.name}.lora_A", lora.r * p.in_features, p.split if p.row_parallel else "none",
                               p.place))
        out.append(ParamTensor(f"{p.name}.lora_B", p.out_features * lora.r, "none" if p.row_parallel else p.split,
                               p.place))
    return out


def adapter_params(spec: ModelSpec, lora: LoraSpec) -> int:
    """Trainable parameters of the whole model: PEFT's `get_nb_trainable_parameters()[0]`."""
    return spec.extra_tensors_per_gpu(adapter_tensors(spec, lora)).elements


def frozen_base_bytes(spec: ModelSpec, lora: LoraSpec, dtype_bytes: int, tp: int = 1, pp: int = 1,
                      expert_shards: int | None = None, dense_ranks: int = 1, expert_ranks: int = 1) -> int:
    """The frozen base on the busiest GPU: linear layers in the base format, the rest at `dtype_bytes`; ZeRO-3
    partitions each tensor over `dense_ranks` (routed experts over `expert_ranks`)."""
    fmt = lora.base_format

    def bytes_of(p: ParamTensor, n: int) -> int:
        if p.storage != "linear" or lora.base_quantization == "none":
            nbytes = n * dtype_bytes
        elif fmt is not None:
            nbytes = fmt.bytes(n)
        else:  # int8: a float32 scale per output row this GPU holds (all rows of a row-parallel shard)
            row = p.in_features // tp if p.row_parallel else p.in_features
            nbytes = n + 4 * (n // row)
        return -(-nbytes // (expert_ranks if p.split == "experts" else dense_ranks))

    return spec.stage_bytes(tp, pp, expert_shards, bytes_of)


def adapter_slot_bytes(spec: ModelSpec, max_loras: int, max_lora_rank: int, dtype_bytes: int, tp: int = 1,
                       pp: int = 1) -> int:
    """Serving's adapter slots on the busiest GPU, as vLLM allocates them: for each of `max_loras` slots, A
    and B at `max_lora_rank` for every projection of every layer (q, k, v, o, gate, up, down; not the
    embeddings, the LM head or routed experts), in the serving dtype, split over TP as in training."""
    every = LoraSpec(r=max_lora_rank, target_modules=LORA_TARGETS)
    return max_loras * spec.extra_tensors_per_gpu(adapter_tensors(spec, every), tp, pp).elements * dtype_bytes
