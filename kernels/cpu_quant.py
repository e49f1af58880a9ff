"""Matmuls on GGUF block-quantized weights on the CPU: kernels/cpu_quant.cpp (built on first use
by kernels/cpu_build.load_quant) behind one call, linear(x, blocks, fmt, bias).

A weight is its GGUF rows as stored: uint8 [N, K / block weights * block bytes], blocks in order
along each row (blocks of 32 weights for Q8_0/Q4_0/Q4_1, super-blocks of 256 for Q4_K/Q6_K; the
C++ file gives each format's block layout). Which kernel runs, by the number of activation rows M
(measured on the 2-core AVX-512 machine, benchmarks/quant/):
  M <= DEQUANT_GEMM_ROWS   (LARGE_REGISTER_ROWS for bf16 rows against a weight of TILED_GEMM_WEIGHTS or
                           more: an LM head) linear_f32: each block dequantized to float in registers and FMA'd
                           against up to 8 rows at once; exact float math, so it agrees with the
                           dequantize-then-matmul reference to summation order.
  M >  DEQUANT_GEMM_ROWS   bf16 activations: linear_bf16_tiled, 64 weight rows at a time
                           dequantized to bf16 into a tile that stays in L2 and multiplied by
                           oneDNN's brgemm (AMX here); float32 activations: linear_f32_tiled, the
                           same with float tiles and one sgemm each (any CPU: on the AVX2 machine
                           2-5x dequantize-then-GEMM for the default model's layers at 17-64 rows,
                           3-9x for its LM head, even at 128 rows; an AVX2 build multiplies each
                           tile with its own 6 x 16 register micro-kernel instead, 1.1-1.45x
                           sgemm). Up to TILED_GEMM_ROWS rows, or at any M for a weight too big to
                           reuse from cache (an LM head); otherwise the whole weight dequantized
                           to the activations' dtype, then F.linear (oneDNN/MKL GEMM): the
                           dequantization is paid once for M rows. bf16 rows where bf16 brgemm does
                           not run (AVX2) are widened and take the float32 kernels: oneDNN's bf16
                           GEMM is 3-8x slower than float32 there.
Where the caller asks for quantized activations (EngineConfig.cpu_gguf_activations, for a GGUF
file's 32-weight formats), up to ACTIVATION_ROWS of the register kernel's rows take integer dot
products instead:
  "int16"  linear_q16: each 32-block of a row scaled to int16 (amax / 32767), vpmaddwd against the
           weights widened to int16 (AVX2 builds): a little faster than linear_f32 on the AVX2
           machine at a relative error ~2e-5 (int8's ~5e-3), so perplexity does not move;
  "int8"   linear_q8: llama.cpp's scheme (amax / 127, vpmaddubsw or AVX-512 VNNI), faster still on
           Q4_1 (nothing on Q8_0), at a perplexity cost under 1% on the default model.
Each row is quantized on its own, so a row's output does not depend on how many rows share the call.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels import cpu_build
from kernels.cpu_build import load_quant


class KernelFormat(NamedTuple):
    id: int  # the C++ Format enum
    block_weights: int
    block_bytes: int


# The block formats the C++ kernels read, by GGUF type name (BF16: a bfloat16 matrix as stored,
# engine.quant.BF16, in blocks of 32 with no scale).
FORMATS = {"Q8_0": KernelFormat(0, 32, 34), "Q4_0": KernelFormat(1, 32, 18), "Q4_1": KernelFormat(2, 32, 20),
           "Q4_K": KernelFormat(3, 256, 144), "Q6_K": KernelFormat(4, 256, 210),
           "BF16": KernelFormat(5, 32, 64)}
Q8_FORMATS = ("Q8_0", "Q4_0", "Q4_1")  # the formats linear_q8 reads
# The C++ kernel of each kind of quantized activations.
ACTIVATION_KERNELS = {"int8": "linear_q8", "int16": "linear_q16"}
# The formats where each kind of quantized activations pays at the register kernel's rows (measured:
# int8 gains nothing on Q8_0, whose weights are cheap to widen).
ACTIVATION_FORMATS = {"int8": ("Q4_0", "Q4_1"), "int16": Q8_FORMATS}
# The most rows each kind takes; more take float activations. The float kernel runs up to 8 rows per
# pass over a weight row, the integer ones 4, so past a few rows the float one wins (AVX2 machine,
# benchmarks/quant/activation_rows.py, two runs; time of float / integer: int16 1.19 at 1 row,
# 1.05 / 1.03 at 2, 1.01 / 1.02 at 3, 0.90 / 0.94 at 4, 0.85 / 0.87 at 8; int8 1.25 / 1.37 at 1,
# 1.04 / 1.05 at 4, 1.14 at 6, 0.99 / 0.89 at 8).
ACTIVATION_ROWS = {"int8": 6, "int16": 3}
# Above this many activation rows, dequantize-then-GEMM beats the register kernel (measured).
DEQUANT_GEMM_ROWS = 16
# Up to this many rows the tiled kernel beats dequantizing the whole weight first, for every layer
# shape of the default model (1 thread, benchmarks/quant/README.md); past it only for weights of at
# least TILED_GEMM_WEIGHTS elements, whose dequantized copy would not stay in cache.
TILED_GEMM_ROWS = 128
TILED_GEMM_WEIGHTS = 8 << 20
LARGE_REGISTER_ROWS = 8
# Bytes of a weight dequantized at a time for oneDNN's GEMM where it replaces the tiled kernel (an LM
# head of 49,152 x 576 in bf16 in 7 slices measured 1.1-1.2x slices of 1,024 rows, same speed as 8,192).
GEMM_SLICE_BYTES = 8 << 20
# BF16 weights under bf16 rows past the register kernel, up to this many rows (batched decode), a layer's
# matrix (under TILED_GEMM_WEIGHTS) takes linear_bf16_outer, prompts and LM heads oneDNN's GEMM on the
# matrix as stored, because at 32-64 rows of the default model's layer shapes the first keeps pace
# with oneDNN's packed call without its copy of the weights (benchmarks/quant/bf16_rows.py).
BF16_OUTER_ROWS = 64


def _check(blocks: torch.Tensor, fmt: str) -> int:
    if fmt not in FORMATS:
        raise ValueError(f"block format {fmt!r} has no CPU kernel; supported: {sorted(FORMATS)}")
    return FORMATS[fmt].id


def in_features(blocks: torch.Tensor, fmt: str) -> int:
    f = FORMATS[fmt]
    return blocks.shape[1] // f.block_bytes * f.block_weights


def dequantize(blocks: torch.Tensor, fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, K] in float32 or bfloat16 (others go through float32)."""
    kernel_id = _check(blocks, fmt)
    w = load_quant().dequantize(blocks, kernel_id, in_features(blocks, fmt), dtype == torch.bfloat16)
    return w if w.dtype == dtype else w.to(dtype)


def linear(x: torch.Tensor, blocks: torch.Tensor, fmt: str, bias: torch.Tensor | None = None,
           activations: str | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(blocks)^T (+ bias) -> [..., N] in x.dtype. activations "int16" or
    "int8": at the register kernel's rows, x quantized so per block (the caller checked
    takes_activations)."""
    kernel_id = _check(blocks, fmt)
    rows = x.reshape(-1, x.shape[-1])
    small = register_rows(rows.shape[0], blocks.shape[0] * rows.shape[1], x.dtype == torch.bfloat16)
    if small and activations is not None and rows.shape[0] <= ACTIVATION_ROWS[activations] and \
            x.dtype in (torch.float32, torch.bfloat16):
        y = getattr(load_quant(), ACTIVATION_KERNELS[activations])(rows.contiguous(), blocks, kernel_id)
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], blocks.shape[0])
    if not small:
        if x.dtype == torch.bfloat16 and not has_brgemm_bf16():
            if native_bf16_matmul():
                if fmt == "BF16" and not cpu_build.helpers():
                    return _bf16_as_stored(x, rows, blocks, bias)
                # AVX512_BF16 without AMX (Zen 4/5): no bf16 brgemm for the tiled kernel, but oneDNN's bf16
                # GEMM runs 4x MKL's sgemm here. A layer's weight is dequantized whole (it stays in
                # cache), a bigger one (an LM head) a slice of GEMM_SLICE_BYTES at a time
                # (benchmarks/quant/gemm_rows.py --dtype bfloat16: 1.9-2.1x widening at 32 rows, 4.3-4.9x at
                # 2,048; an LM head 2.1x at 17 rows, 2.4x at 32, 3.7x at 128). With the kernels' helpers
                # on (CPUs shared with other processes, cpu_build.set_helpers), slices go to torch's
                # thread and the helpers alike, each its own GEMM: the same bits.
                if cpu_build.helpers():
                    y = load_quant().linear_dequant_gemm(rows.contiguous(), blocks, kernel_id, bias)
                    return y.reshape(*x.shape[:-1], blocks.shape[0])
                return _sliced_gemm(x, blocks, fmt, bias)
            # Neither brgemm nor native bf16 (an AVX2 CPU): oneDNN's bf16 GEMM runs 3-8x slower than float32
            # at 16-256 rows there, so the rows are widened once and take the float32 kernels.
            y = linear(rows.float(), blocks, fmt)
            if bias is not None:
                y += bias
            return y.to(x.dtype).reshape(*x.shape[:-1], blocks.shape[0])
        if x.dtype == torch.float32 and onednn_float32():
            return _sliced_gemm(x, blocks, fmt, bias)
        if _tiled(rows.shape[0], blocks.shape[0] * rows.shape[1], x.dtype):
            tiled = load_quant().linear_f32_tiled if x.dtype == torch.float32 else load_quant().linear_bf16_tiled
            y = tiled(rows.contiguous(), blocks, kernel_id)
            if bias is not None:
                y += bias
            return y.reshape(*x.shape[:-1], blocks.shape[0])
        return F.linear(x, dequantize(blocks, fmt, x.dtype), bias)
    if x.dtype in (torch.float32, torch.bfloat16):  # the kernel reads and writes these itself
        y = load_quant().linear_f32(rows.contiguous(), blocks, kernel_id)
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], blocks.shape[0])
    y = load_quant().linear_f32(rows.float().contiguous(), blocks, kernel_id)
    if bias is not None:
        y += bias
    return y.to(x.dtype).reshape(*x.shape[:-1], blocks.shape[0])


def _bf16_as_stored(x: torch.Tensor, rows: torch.Tensor, blocks: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """bf16 rows past the register kernel against BF16 blocks, nothing to decode: a layer's matrix
    (under TILED_GEMM_WEIGHTS) at up to BF16_OUTER_ROWS rows by linear_bf16_outer, else oneDNN's GEMM
    on the matrix as stored (the blocks viewed as bfloat16 [N, K]: no copy)."""
    if rows.shape[0] <= BF16_OUTER_ROWS and blocks.shape[0] * rows.shape[1] < TILED_GEMM_WEIGHTS and has_bf16_dots():
        y = load_quant().linear_bf16_outer(rows.contiguous(), blocks)
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], blocks.shape[0])
    return F.linear(x, blocks.view(torch.bfloat16), bias)


def _sliced_gemm(x: torch.Tensor, blocks: torch.Tensor, fmt: str, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ dequantize(blocks)^T in x's dtype with oneDNN's GEMM (bf16: F.linear; float32: oneDNN's
    linear, which F.linear's MKL sgemm is not), the weight dequantized in slices of about
    GEMM_SLICE_BYTES, so that each slice is multiplied while it is in cache."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    step = max(16, GEMM_SLICE_BYTES // (x.element_size() * rows.shape[1]))
    n = blocks.shape[0]

    def gemm(part: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        w = dequantize(part, fmt, x.dtype)
        return F.linear(rows, w, b) if x.dtype == torch.bfloat16 else onednn_linear(rows, w, b)

    if n <= step:
        return gemm(blocks, bias).reshape(*x.shape[:-1], n)
    out = rows.new_empty(rows.shape[0], n)
    for start in range(0, n, step):
        out[:, start:start + step] = gemm(blocks[start:start + step], None)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], n)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T + bias by oneDNN (F.linear's float32 path is MKL's sgemm); weight plain, or in
    oneDNN's blocked layout (cpu_ops.pack_linear_weight)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def onednn_float32() -> bool:
    """Whether float32 rows past the register kernel take oneDNN's GEMM on the dequantized weight
    (_sliced_gemm) rather than the tiled kernel or MKL's sgemm: on AVX-512 CPUs without AMX. Measured
    on a Zen 5 (benchmarks/quant/gemm_rows.py --dtype float32): MKL's sgemm ran at 190-200 GFLOP/s there and
    oneDNN's at ~460: 1.1-2.2x the old paths at 17-2,048 rows; AMX CPUs and AVX2 ones keep the tiled
    kernel they were measured with."""
    return (torch.backends.mkldnn.is_available() and not has_brgemm_bf16()
            and torch.backends.cpu.get_cpu_capability() == "AVX512")


def _tiled(rows: int, weights: int, dtype: torch.dtype) -> bool:
    """Float32 rows, or bf16 ones where linear_bf16_tiled runs (linear widens them elsewhere)."""
    if rows > TILED_GEMM_ROWS and weights < TILED_GEMM_WEIGHTS:
        return False
    return dtype in (torch.float32, torch.bfloat16)


def register_rows(rows: int, weights: int, bf16: bool) -> bool:
    """Whether the register kernel takes `rows`: up to DEQUANT_GEMM_ROWS, but for bf16 rows against a
    weight too big for cache (an LM head) only up to LARGE_REGISTER_ROWS, past which the tiled
    kernel's one dequantization beats the register kernel's pass per 4 rows (measured, cold cache:
    49152 x 576 Q8_0 at 16 rows 8.3 vs 5.0 ms, at 8 rows 4.4 vs 4.7)."""
    if bf16 and weights >= TILED_GEMM_WEIGHTS and has_brgemm_bf16():
        return rows <= LARGE_REGISTER_ROWS
    return rows <= DEQUANT_GEMM_ROWS


def native_bf16_matmul() -> bool:
    """Whether oneDNN multiplies bfloat16 natively here (AVX-512 BF16 / AMX). Without it (an AVX2-only
    CPU) its bf16 GEMM measured 3-8x slower than float32 at 16-256 rows, so bf16 weights are better
    widened to float32 inside the block kernels (engine/loading/weights.py KeepBF16). With AVX512_BF16 alone
    (no AMX, so no brgemm: Zen 4/5) it runs 4x MKL's float32 sgemm."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def has_bf16_dots() -> bool:
    """Whether bf16 rows meet BF16 weights in bf16 dot products here (AVX512_BF16; kernels/cpu_quant.cpp)."""
    return bool(load_quant().has_bf16_dots())


@functools.cache
def has_brgemm_bf16() -> bool:
    """Whether linear_bf16_tiled runs here (oneDNN's bf16 brgemm: AVX512_BF16 or AMX)."""
    return bool(load_quant().has_brgemm_bf16())


def linear_int(x: torch.Tensor, blocks: torch.Tensor, fmt: str, activations: str) -> torch.Tensor:
    """x quantized per 32-block to `activations` ("int8": llama.cpp's scheme; "int16": AVX2 builds),
    then integer dot products, at any number of rows; float32 [M, N]."""
    name = ACTIVATION_KERNELS[activations]
    if fmt not in Q8_FORMATS:
        raise ValueError(f"{name} reads {', '.join(Q8_FORMATS)} blocks, not {fmt!r}")
    return getattr(load_quant(), name)(x.float().contiguous(), blocks, _check(blocks, fmt))


def linear_q8(x: torch.Tensor, blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    return linear_int(x, blocks, fmt, "int8")


def linear_q16(x: torch.Tensor, blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    return linear_int(x, blocks, fmt, "int16")


def takes_activations(fmt: str, activations: str) -> bool:
    """Whether linear(..., activations=...) pays for `fmt` here: a format where it is faster, on a
    build and CPU with those integer dot products."""
    if fmt not in ACTIVATION_FORMATS.get(activations, ()):
        return False
    return bool(load_quant().has_int16_dots() if activations == "int16" else load_quant().has_int8_dots())


def has_vnni() -> bool:
    return bool(load_quant().has_vnni())
