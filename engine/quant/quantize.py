"""`--quantization int8 | int4`: a float checkpoint's linear weights quantized at load, weight-only,
and kept in GGUF's block layouts so that the kernels already tested for GGUF files serve them
(kernels/cpu_quant.cpp on the cpu backend, dequantize + F.linear elsewhere). The layouts cost some
bytes against a layout made for each scheme; that is the price of one set of kernels.

int8, per output channel, symmetric: d = amax(|row|) / 127, q = round(w / d) in [-127, 127], stored
as Q8_0 blocks (fp16 d, 32 int8) with the row's d repeated in each of its 32-blocks, so the Q8_0
kernels compute exactly d * q. 34 bytes per 32 weights: 8.5 bits per weight stored.

int4, asymmetric, groups of g = 32 or 128 inputs along each row: d = (max - min) / 15, m = min,
q = round((w - m) / d) in [0, 15], w ~ d * q + m, stored as Q4_1 blocks (fp16 d, fp16 m, 16 bytes
of nibbles in GGUF's order: low nibbles weights 0..15, high nibbles 16..31), a group of 128's d and
m repeated in its four 32-blocks. 20 bytes per 32 weights: 5.0 bits per weight stored, for either g.

Rounding: d (and m) are rounded to fp16 first and q is computed against the rounded values, so the
kernels' w' = d * q (+ m) misses w by q's rounding alone, |w - w'| <= d / 2, except where q is
clamped at an end of the range because fp16 rounded d down (or m up): there the miss is at most
127 |d - amax / 127| (int8) or 15 |d - (max - min) / 15| + |m - min| (int4), i.e. 2^-11 of the
values concerned in fp16's normal range. tests/engine/quant/test_weight_quantization.py checks both the
blocks (byte for byte against a float64 reference) and this bound.

fp8 (e4m3 with a float32 scale per tensor, vLLM's) is engine/quant/fp8.py's, in its F8_E4M3 blocks.

Arithmetic: scales are computed in float64, then rounded float64 -> float32 -> float16 (the
conversions torch and numpy both define the same way); the quotients in float64, rounded half to
even. A row of a zero weight gets d = 0 and q = 0.
"""

from __future__ import annotations

import torch

from engine.config import AT_LOAD_QUANTIZATIONS as AT_LOAD_METHODS  # quantize float weights at load
from engine.quant.formats import BLOCK_SIZE, FORMATS
from engine.quant.fp8 import F8_E4M3, FP8_BITS_PER_WEIGHT, quantize_fp8
from engine.quant.tensor import QuantizedTensor

INT8_BITS_PER_WEIGHT = 8 * FORMATS["Q8_0"].block_bytes / BLOCK_SIZE  # 8.5
INT4_BITS_PER_WEIGHT = 8 * FORMATS["Q4_1"].block_bytes / BLOCK_SIZE  # 5.0
_CHUNK = 1 << 22  # weights quantized at once: bounds the float64 temporaries (32 MiB each)


def to_fp16(x: torch.Tensor) -> torch.Tensor:
    """float64 -> float32 -> float16, each step round-to-nearest-even (spelled out: a direct
    float64 -> float16 conversion rounds once, and torch's rounds twice anyway)."""
    return x.to(torch.float32).to(torch.float16)


def pack_q8_0(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks: d fp16 [N, K / 32] (each block's scale), q int8 [N, K] -> uint8 [N, K / 32 * 34]."""
    n, k = q.shape
    scale = d.to(torch.float16).contiguous().view(torch.uint8).reshape(n, k // BLOCK_SIZE, 2)
    quants = q.to(torch.int8).contiguous().view(torch.uint8).reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)
    return torch.cat([scale, quants], dim=-1).reshape(n, -1)


def _nibble_bytes(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] in [0, 15] -> [N, K / 32, 16]: byte j of a block = weight j | weight j + 16 << 4."""
    n, k = q.shape
    blocks = q.to(torch.uint8).reshape(n, k // BLOCK_SIZE, 2, BLOCK_SIZE // 2)
    return blocks[:, :, 0] | (blocks[:, :, 1] << 4)


def _halves(x: torch.Tensor, n: int, nb: int) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(n, nb, 2)


def pack_q4_0(d: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks (w = d * (q - 8)): d fp16 [N, K / 32], q [N, K] in [0, 15] -> uint8 [N, K / 32 * 18]."""
    n, k = q.shape
    nb = k // BLOCK_SIZE
    return torch.cat([_halves(d, n, nb), _nibble_bytes(q)], dim=-1).reshape(n, -1)


def pack_q4_1(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks (w = d * q + m): d, m fp16 [N, K / 32], q [N, K] in [0, 15] -> uint8 [N, K / 32 * 20]."""
    n, k = q.shape
    nb = k // BLOCK_SIZE
    return torch.cat([_halves(d, n, nb), _halves(m, n, nb), _nibble_bytes(q)], dim=-1).reshape(n, -1)


def per_block(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K / group_size] -> [N, K / 32]: each group's value repeated in each of its 32-blocks."""
    return x.repeat_interleave(group_size // BLOCK_SIZE, dim=1)


def _row_chunks(w: torch.Tensor, dtype: torch.dtype = torch.float64):
    step = max(1, _CHUNK // max(1, w.shape[1]))
    for start in range(0, w.shape[0], step):
        yield w[start:start + step].to(dtype)


def check_quantizable(in_features: int, method: str, group_size: int, what: str) -> None:
    """ValueError, naming the flag, where `what`'s rows cannot be cut into the method's blocks/groups."""
    unit = group_size if method == "int4" else BLOCK_SIZE
    if in_features % unit == 0:
        return
    if method == "int4":
        fix = ("use --quantization-group-size 32" if group_size != 32 and in_features % 32 == 0
               else "use --quantization int8, or no --quantization")
        raise ValueError(f"--quantization int4 --quantization-group-size {group_size}: {what} has {in_features} "
                         f"inputs per row, not a multiple of {group_size}: {fix}")
    raise ValueError(f"--quantization {method}: {what} has {in_features} inputs per row, not a multiple of the "
                     f"{BLOCK_SIZE}-weight blocks the {method} kernels read: drop --quantization for this model")


def quantize_int8(w: torch.Tensor) -> QuantizedTensor:
    """Per-output-channel symmetric int8, as Q8_0 blocks (see the module docstring)."""
    n, k = w.shape
    check_quantizable(k, "int8", BLOCK_SIZE, "this weight")
    out = []
    for x in _row_chunks(w):
        d = to_fp16(x.abs().amax(dim=1, keepdim=True) / 127)
        dd = d.double()
        q = torch.where(dd > 0, torch.round(x / torch.where(dd > 0, dd, 1.0)), 0.0).clamp_(-127, 127)
        out.append(pack_q8_0(d.expand(-1, k // BLOCK_SIZE), q.to(torch.int8)))
    return QuantizedTensor(torch.cat(out), FORMATS["Q8_0"])


def quantize_int4(w: torch.Tensor, group_size: int) -> QuantizedTensor:
    """Group-wise asymmetric 4-bit with min and scale per group, as Q4_1 blocks (see the module docstring)."""
    n, k = w.shape
    check_quantizable(k, "int4", group_size, "this weight")
    out = []
    for x in _row_chunks(w):
        g = x.reshape(x.shape[0], k // group_size, group_size)
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        d, m = to_fp16((hi - lo) / 15), to_fp16(lo)
        dd, mm = d.double().unsqueeze(2), m.double().unsqueeze(2)
        q = torch.where(dd > 0, torch.round((g - mm) / torch.where(dd > 0, dd, 1.0)), 0.0).clamp_(0, 15)
        out.append(pack_q4_1(per_block(d, group_size), per_block(m, group_size), q.reshape(-1, k).to(torch.uint8)))
    return QuantizedTensor(torch.cat(out), FORMATS["Q4_1"])


def quantize_q8_0(w: torch.Tensor) -> QuantizedTensor:
    """GGUF's own Q8_0 (a scale per 32 weights), as llama.cpp's quantizer and gguf-py's compute it: in
    float32, d = amax(|block|) / 127, q = w * (1 / d) rounded half away from zero, d stored as fp16.
    Byte for byte gguf.quants.quantize's (tests/engine/quant/test_weight_quantization.py)."""
    n, k = w.shape
    out = []
    for rows in _row_chunks(w, torch.float32):
        x = rows.reshape(-1, k // BLOCK_SIZE, BLOCK_SIZE)
        d = x.abs().amax(dim=2, keepdim=True) / 127
        v = x * torch.where(d == 0, 0.0, 1 / d)
        a = v.abs()
        whole = a.floor()
        q = torch.sign(v) * (whole + (2 * (a - whole)).floor())  # roundf: half away from zero
        out.append(pack_q8_0(d.squeeze(2), q.reshape(x.shape[0], k).to(torch.int8)))
    return QuantizedTensor(torch.cat(out), FORMATS["Q8_0"])


# --quantize-lm-head: the format the LM head (and a tied embedding) is kept in under each method.
# int8 and int4 keep it at 8 bits with a scale per 32 weights, GGUF's Q8_0, as llama.cpp's Q4 files
# do (the default model's Q4_1 file holds its tied embedding as Q8_0): the head of a small model
# loses more to 4 bits than its layers do, and 8 bits cost it no perplexity (BENCHMARKS.md,
# "Weight formats: quality"). fp8 keeps it as its layers.
LM_HEAD_FORMATS = {"int8": FORMATS["Q8_0"], "int4": FORMATS["Q8_0"], "fp8": F8_E4M3}


def lm_head_format(method: str):
    """The block format `method` with --quantize-lm-head keeps the LM head in."""
    return LM_HEAD_FORMATS[method]


def check_lm_head_quantizable(in_features: int, what: str) -> None:
    """ValueError, naming the flag, where the head's rows cannot be cut into 32-weight blocks."""
    if in_features % BLOCK_SIZE:
        raise ValueError(f"--quantize-lm-head: {what} has {in_features} inputs per row, not a multiple of the "
                         f"{BLOCK_SIZE}-weight blocks it would be kept in: drop --quantize-lm-head for this model")


def quantize_lm_head(w: torch.Tensor, method: str) -> QuantizedTensor:
    """The LM head's (or a tied embedding's) float [vocabulary, hidden] matrix in lm_head_format(method)."""
    check_lm_head_quantizable(w.shape[1], "the LM head")
    return quantize_fp8(w) if method == "fp8" else quantize_q8_0(w)


def quantize(w: torch.Tensor, method: str, group_size: int = 128) -> QuantizedTensor:
    """`method` "int8", "int4" or "fp8" (EngineConfig.quantization) of a float [out, in] weight."""
    if method == "int8":
        return quantize_int8(w)
    if method == "int4":
        return quantize_int4(w, group_size)
    if method == "fp8":
        check_quantizable(w.shape[1], method, BLOCK_SIZE, "this weight")
        return quantize_fp8(w)  # per tensor, as vLLM's --quantization fp8
    raise ValueError(f"quantization {method!r} does not quantize float weights at load; {AT_LOAD_METHODS} do")


def block_format(method: str):
    """The block format `method`'s weights are kept in."""
    if method == "fp8":
        return F8_E4M3
    return FORMATS["Q8_0" if method == "int8" else "Q4_1"]


def describe(method: str, group_size: int) -> str:
    """One line for the start-up log: what the layers now hold, and the cost of the shared kernels."""
    if method == "fp8":
        return ("fp8 e4m3 weight-only, one float32 scale per tensor (amax / 448, vLLM's), kept as F8_E4M3 blocks "
                f"with the scale in every 32-block: {FP8_BITS_PER_WEIGHT:g} bits per weight stored")
    if method == "int8":
        return ("int8 per-channel symmetric (scale = amax(row) / 127), kept as Q8_0 blocks with the row's scale "
                f"in every 32-block: {INT8_BITS_PER_WEIGHT:g} bits per weight stored, the Q8_0 kernels compute "
                "exactly scale * q")
    return (f"int4 asymmetric, groups of {group_size} (scale = (max - min) / 15, min), kept as Q4_1 blocks"
            + (f" with each group's scale and min repeated in its {group_size // BLOCK_SIZE} 32-blocks"
               if group_size > BLOCK_SIZE else "")
            + f": {INT4_BITS_PER_WEIGHT:g} bits per weight stored, served by the Q4_1 kernels")
