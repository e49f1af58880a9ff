"""Weight formats: the bytes a served weight takes as the engine stores it, scales included.

A block format keeps each run of `block_size` consecutive weights of a row as one block of `block_bytes`
(the quantized values and their scale, and a min where the format has one), so a tensor of n weights takes
n / block_size x block_bytes bytes, and a tensor-parallel shard the same rule on its own elements (rows split
whole; input columns split in whole blocks, engine/quant/formats.py). Bits per weight = 8 x block_bytes /
block_size.

Which tensors a format applies to is the engine's rule for `--quantization` (spec.ParamTensor.storage): linear
layers' weights, and with `--quantize-lm-head` (WeightFormat.lm_head) the LM head and a tied embedding (the
head's matrix) in WeightFormat.head_as; an untied embedding, the LM head by default, norms and biases stay at
the model's dtype (a GGUF file's own embedding and LM head blocks are held as stored,
engine/layers/embedding.py), the MoE router in float32, and routed experts at the model's dtype (the engine's
fused experts have no quantized path: a GGUF's expert blocks are dequantized at load, engine/loading/weights.py). A
tied matrix counts once, as the model's parameters hold it; a float head's packed copy comes on top (oneDNN's
layout on the cpu backend), while the triton backend's repacked copy of quantized blocks replaces them (a tied
embedding looks its rows up there).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine.planning.spec import ModelSpec, ParamTensor


@dataclass(frozen=True)
class WeightFormat:
    name: str
    block_size: int  # weights per block
    block_bytes: int  # bytes of one block, scales included
    tensor_bytes: int = 0  # per tensor on top of its blocks (fp8's per-tensor scale)
    stored_as: str = ""  # how the engine lays it out, when it is another format's blocks
    lm_head: bool = False  # --quantize-lm-head: the LM head (and a tied embedding) quantized too, as head_as
    head_as: str = ""  # the format --quantize-lm-head keeps the head in (engine/quant/quantize.py LM_HEAD_FORMATS)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_size

    def bytes(self, elements: int) -> int:
        """One tensor (or one GPU's shard of it) of `elements` weights; a partial block costs a whole one."""
        return -(-elements // self.block_size) * self.block_bytes + self.tensor_bytes


# Block layouts from ggml's ggml/src/ggml-common.h (ggml-org/llama.cpp), `ggml_half` = 2 bytes, QK_K = 256:
#   block_q8_0 = d + int8 qs[32]                          = 34 bytes / 32 weights  (8.5 bits)
#   block_q4_0 = d + uint8 qs[16]                         = 18 bytes / 32 weights  (4.5 bits)
#   block_q4_1 = d, m + uint8 qs[16]                      = 20 bytes / 32 weights  (5.0 bits)
#   block_q4_K = d, dmin + scales[12] + qs[128]           = 144 bytes / 256 weights (4.5 bits)
#   block_q6_K = ql[128] + qh[64] + int8 scales[16] + d   = 210 bytes / 256 weights (6.5625 bits)
# gguf-py's GGML_QUANT_SIZES holds the same (block size, bytes) pairs (tests/planning/test_weight_formats.py).
GGUF_FORMATS = (
    WeightFormat("Q8_0", 32, 34),
    WeightFormat("Q4_0", 32, 18),
    WeightFormat("Q4_1", 32, 20),
    WeightFormat("Q4_K", 256, 144),
    WeightFormat("Q6_K", 256, 210),
)
_GGUF = {f.name: f for f in GGUF_FORMATS}
# `--quantization` of the engine (applied at load to a float checkpoint), stored as GGUF blocks so that one
# set of kernels serves both: int8 as Q8_0 (a scale per 32 weights); int4 as Q4_1 (asymmetric: a scale and a
# min per 32 weights; a group of 128 shares its scale but is still stored as four Q4_1 blocks, so 5.0 bits
# either way). fp8 (e4m3) as the engine keeps it (engine/quant/fp8.py): F8_E4M3 blocks of 32 bytes and the
# tensor's float32 scale repeated in each, 9 bits a weight, where vLLM's Fp8LinearMethod keeps one byte a weight
# and one float32 per tensor (vllm/model_executor/layers/quantization/fp8.py: PerTensorScaleParameter), 8 bits.
ENGINE_FORMATS = (
    WeightFormat("int8", 32, 34, stored_as="Q8_0", head_as="Q8_0"),
    WeightFormat("int4", 32, 20, stored_as="Q4_1", head_as="Q8_0"),  # an 8-bit head, as llama.cpp's Q4 files
    WeightFormat("fp8", 32, 36, head_as="fp8"),
)
FORMATS: dict[str, WeightFormat] = {f.name: f for f in (*ENGINE_FORMATS, *GGUF_FORMATS)}
assert all(_GGUF[f.stored_as].block_bytes == f.block_bytes for f in ENGINE_FORMATS if f.stored_as)


def weight_format(name: str) -> WeightFormat:
    """A format by name, case-insensitively (q4_k, Q4_K); ValueError listing the known ones."""
    found = {key.lower(): f for key, f in FORMATS.items()}.get(str(name).lower())
    if found is None:
        raise ValueError(f"unknown weight format {name!r}; use one of {', '.join(FORMATS)}")
    return found


def _arg(names: tuple[str, ...], hint: str):
    def parse(text: str) -> WeightFormat:
        fmt = {n.lower(): FORMATS[n] for n in names}.get(text.lower())
        if fmt is None:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(names)}{hint}")
        return fmt

    parse.__name__ = "format"
    return parse


# argparse types: `--quantization` takes the engine's at-load methods, `--weight-format` a GGUF
# file's block type (the engine reads that from the file itself).
quantization_arg = _arg(tuple(f.name for f in ENGINE_FORMATS),
                        "; a pre-quantized GPTQ / AWQ / compressed-tensors checkpoint is converted at load to GGUF "
                        "blocks: give --weight-format Q4_0 (4-bit symmetric), Q4_1 (4-bit asymmetric, AWQ) or Q8_0 "
                        "(8-bit)")
gguf_type_arg = _arg(tuple(f.name for f in GGUF_FORMATS), "")


def tensor_bytes(p: ParamTensor, elements: int, dtype_bytes: int, fmt: WeightFormat | None) -> int:
    """Bytes of `elements` weights of tensor `p` as the engine serves it."""
    if fmt is not None and p.storage == "linear":
        return fmt.bytes(elements)
    if fmt is not None and p.storage == "head" and fmt.lm_head:
        return FORMATS[fmt.head_as].bytes(elements)
    return elements * (4 if p.storage == "float32" else dtype_bytes)


def weight_bytes_per_gpu(spec: ModelSpec, dtype_bytes: int, fmt: WeightFormat | None = None, tp: int = 1,
                         pp: int = 1, expert_shards: int | None = None) -> int:
    """Weight bytes on the busiest GPU of a TP x PP serving layout, linear layers in `fmt` (None: the dtype)."""
    return spec.stage_bytes(tp, pp, expert_shards, lambda p, n: tensor_bytes(p, n, dtype_bytes, fmt))
