"""Triton weight-only matmul on GGUF block-quantized weights: y = x @ dequantize(W)^T (+ bias).

W is kept as engine/quant stores it: uint8 [N, K / block_size * block_bytes], each row its blocks in
order (Q8_0, Q4_0, Q4_1, F8_E4M3: 32 weights a block; Q4_K, Q6_K: super-blocks of 256).
`--quantization int8` gives Q8_0 blocks, `int4` Q4_1, GPTQ / AWQ / compressed-tensors Q4_0 / Q4_1 /
Q8_0; fp8 weights are F8_E4M3 blocks (engine/quant/fp8.py: a float32 scale, then 32 e4m3 bytes).
The engine's triton backend multiplies Q8_0 / Q4_0 / Q4_1 through their repacked copies instead
(triton_quant_packed.py: 1.0-2.5x this kernel's speed at 1 and 16 rows on an H100); here the engine
runs the K-quants and fp8. e4m3 is decoded with integer operations rather than Triton's fp8
conversions, which need sm_89+: Ampere runs it too.

The shape of vLLM's and SGLang's Triton weight-only GEMMs: a program owns a BLOCK_M x BLOCK_N tile
of y, steps along K in whole scale groups (32 weights; Q6_K's 16), loads the step's raw bytes,
dequantizes them in registers to x's dtype exactly as engine.quant's dequantize does (float32
scale arithmetic, then one rounding to x's dtype) and feeds tl.dot, accumulating in float32. The
weight tile is laid out [groups, group size, BLOCK_N], so each group's scale (and min) is loaded
once and broadcast over its weights. Small batches (decode) leave most SMs idle with one program per
column tile, so K is split over more programs, each writing a float32 partial that a second small
kernel sums with the bias (deterministic, no atomics). Every choice comes from shapes; nothing is
read back from the GPU, so a decode step that calls it can be captured in a CUDA graph, and
warmup() can compile every binary a model's layers will pick before serving.

Imported only once the triton backend is chosen (engine/quant/formats.py), like triton_ops.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import triton_ops

# engine.quant format name -> (FORMAT id in the kernel, weights a scale group holds, weights a
# block holds, bytes a block holds); the layouts are drawn in engine/quant/formats.py.
FORMATS = {"Q8_0": (0, 32, 32, 34), "Q4_0": (1, 32, 32, 18), "Q4_1": (2, 32, 32, 20),
           "Q4_K": (3, 32, 256, 144), "Q6_K": (4, 16, 256, 210), "F8_E4M3": (5, 32, 32, 36)}
# Split K until this many programs per SM would run (or the steps run out): a decode GEMV of a
# 2048-wide layer has only N / BLOCK_N column tiles, a fraction of an H100's 132 SMs.
PROGRAMS_PER_SM = 2
MIN_STEPS_PER_SPLIT = 4  # K steps each split keeps: fewer and the partial sums cost more than they win
MAX_SPLIT_K = 16


@triton.jit
def _fp16_at(ptr, mask):
    """The little-endian fp16 at byte `ptr` (any alignment), as float32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _float32_at(ptr, mask):
    """The little-endian float32 at byte `ptr` (any alignment)."""
    bits = tl.load(ptr, mask=mask, other=0).to(tl.uint32)
    for i in tl.static_range(1, 4):
        bits |= tl.load(ptr + i, mask=mask, other=0).to(tl.uint32) << (8 * i)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_to_float32(b):
    """e4m3 (fn: no infinities; S.1111.111 is NaN) bytes -> float32, exactly."""
    b = b.to(tl.int32)
    exponent, mantissa = (b >> 3) & 15, b & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)  # 2^(e-7) (1 + m/8)
    magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # subnormal: m 2^-9
    magnitude = tl.where((b & 127) == 127, float("nan"), magnitude)
    return tl.where(b >= 128, -magnitude, magnitude)


@triton.jit
def _dequantize_tile(w_ptr, cols, col_in, stride_w, groups, group_in, FORMAT: tl.constexpr, GROUP: tl.constexpr,
                     BLOCK: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """Weights of scale groups `groups` [G] (group g = inputs g * GROUP ..) of rows `cols` [BLOCK_N],
    float32 [G, GROUP, BLOCK_N]; masked-off rows and groups read as 0."""
    group_ptr = (w_ptr + cols.to(tl.int64)[None, :] * stride_w
                 + (groups // (BLOCK // GROUP) * BLOCK_BYTES).to(tl.int64)[:, None])  # its block [G, N]
    g_mask = group_in[:, None] & col_in[None, :]
    e = tl.arange(0, GROUP)[None, :, None]  # the weight within its group
    mask = g_mask[:, None, :]
    if FORMAT == 0:  # Q8_0: fp16 d, 32 int8
        q = tl.load(group_ptr[:, None, :] + 2 + e, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = _fp16_at(group_ptr, g_mask)[:, None, :] * q
    elif FORMAT == 1 or FORMAT == 2:  # Q4_0: fp16 d, 16 bytes; Q4_1: fp16 d, fp16 m, 16 bytes
        # byte j holds weight j in its low nibble, weight j + 16 in its high one
        d = _fp16_at(group_ptr, g_mask)[:, None, :]
        if FORMAT == 1:
            qs = group_ptr[:, None, :] + 2 + e % 16
            w = d * (((tl.load(qs, mask=mask, other=0) >> (e // 16 * 4)) & 0x0F).to(tl.float32) - 8.0)
        else:
            qs = group_ptr[:, None, :] + 4 + e % 16
            q = ((tl.load(qs, mask=mask, other=0) >> (e // 16 * 4)) & 0x0F).to(tl.float32)
            w = d * q + _fp16_at(group_ptr + 2, g_mask)[:, None, :]
    elif FORMAT == 3:  # Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales / mins, 128 bytes of nibbles
        j = (groups % 8)[:, None]  # sub-block of 32
        s = group_ptr + 4
        a = tl.load(s + j, mask=g_mask, other=0)
        b = tl.load(s + j + 4, mask=g_mask, other=0)
        c = tl.load(s + j % 4, mask=g_mask, other=0)
        # sub-blocks 0..3: 6 bits in bytes 0..3 (scales), 4..7 (mins); 4..7: low 4 bits in bytes
        # 8..11's nibbles, top 2 in the spare top bits of bytes 0..7
        sc = tl.where(j < 4, a & 63, (b & 0x0F) | ((c >> 6) << 4)).to(tl.float32)
        mn = tl.where(j < 4, b & 63, (b >> 4) | ((a >> 6) << 4)).to(tl.float32)
        d = _fp16_at(group_ptr, g_mask) * sc
        dm = _fp16_at(group_ptr + 2, g_mask) * mn
        jj = j[:, None, :]
        qs = group_ptr[:, None, :] + 16 + 32 * (jj // 2) + e  # bytes 32c..: sub-block 2c low, 2c + 1 high
        q = ((tl.load(qs, mask=mask, other=0) >> (4 * (jj % 2))) & 0x0F).to(tl.float32)
        w = d[:, None, :] * q - dm[:, None, :]
    elif FORMAT == 4:  # Q6_K: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales, fp16 d
        j = (groups % 16)[:, None]  # group of 16
        i = j[:, None, :] * 16 + e  # the weight within its super-block
        h, r = i // 128, i % 128  # half, and place in it
        low = (tl.load(group_ptr[:, None, :] + 64 * h + r % 64, mask=mask, other=0) >> (4 * (r // 64))) & 0x0F
        high = (tl.load(group_ptr[:, None, :] + 128 + 32 * h + r % 32, mask=mask, other=0) >> (2 * (r // 32))) & 3
        q = (low | (high << 4)).to(tl.float32) - 32.0
        sc = tl.load(group_ptr + 192 + j, mask=g_mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = (_fp16_at(group_ptr + 208, g_mask) * sc)[:, None, :] * q
    else:  # F8_E4M3: float32 scale, 32 e4m3
        w = _e4m3_to_float32(tl.load(group_ptr[:, None, :] + 4 + e, mask=mask, other=0))
        w = w * _float32_at(group_ptr, g_mask)[:, None, :]
    return w


@triton.jit
def store_tile(out_ptr, bias_ptr, acc, rows, cols, row_in, col_in, stride_out, stride_split, PARTIAL: tl.constexpr,
               HAS_BIAS: tl.constexpr):
    """A program's float32 tile acc [rows, cols] of y: in out's dtype with the bias, or, PARTIAL, as
    this K split's (program axis 2) float32 partial at out + split * stride_split, no bias."""
    out_mask = row_in[:, None] & col_in[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    if PARTIAL:
        tl.store(out_ptrs + tl.program_id(2).to(tl.int64) * stride_split, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["M", "stride_split"])  # batch-sized: a new batch size must not recompile
def quant_matmul_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, groups_per_split, stride_x, stride_w, stride_out,
                        stride_split, FORMAT: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                        BLOCK_BYTES: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) over this program's split of K (axis 2):
    in out's dtype, or, PARTIAL, as float32 partial sums at out + split * stride_split, no bias."""
    G: tl.constexpr = BLOCK_K // GROUP
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in, col_in = rows < M, cols < N
    num_groups = K // GROUP
    first = tl.program_id(2) * groups_per_split
    last = tl.minimum(first + groups_per_split, num_groups)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g0 in range(first, last, G):
        groups = g0 + tl.arange(0, G)
        group_in = groups < last
        w = _dequantize_tile(w_ptr, cols, col_in, stride_w, groups, group_in, FORMAT, GROUP, BLOCK, BLOCK_BYTES)
        w = tl.reshape(w, (BLOCK_K, BLOCK_N)).to(x_ptr.dtype.element_ty)  # as engine.quant rounds it
        k_in = g0 * GROUP + tl.arange(0, BLOCK_K) < last * GROUP
        x = tl.load(x_ptrs + g0 * GROUP, mask=row_in[:, None] & k_in[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    store_tile(out_ptr, bias_ptr, acc, rows, cols, row_in, col_in, stride_out, stride_split, PARTIAL, HAS_BIAS)


@triton.jit(do_not_specialize=["total"])  # rows x N: batch-sized, like quant_matmul_kernel's M
def sum_splits_kernel(out_ptr, part_ptr, bias_ptr, total, N, NUM_SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """out = sum over splits of the float32 partials [NUM_SPLITS, M, N] (+ bias[n]) in out's dtype,
    BLOCK of the M x N outputs a program: split-K's sum, bias and cast in one launch. torch's sum,
    add and copy were three (an H200 profile of a batch-1 int4 step: 98 launches, 167 us; this
    kernel 32 launches, 34 us)."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = idx < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        acc += tl.load(part_ptr + s * total + idx, mask=valid, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + idx % N, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=valid)


SUM_SPLITS_BLOCK = 1024


@dataclass(frozen=True)
class LaunchPlan:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    num_splits: int
    groups_per_split: int  # scale groups of K each split covers: whole K steps


def tiles(num_tokens: int, group: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). A decode batch is a weight-streaming
    GEMV: the fewest rows tl.dot takes (16), narrow column tiles for more programs, long K steps;
    a prefill a GEMM with 64-row tiles. BLOCK_K is whole scale groups. (A CUDA-core GEMV for one
    row on this layout loses to the 16-row tile inside a batch-1 step, because it reads each weight
    row of these blocks as 16-bit words; on the repacked layout of triton_quant_packed.py a one-row
    kernel wins.)"""
    if num_tokens <= 16:
        return 16, 32, max(128, group), 4, 3
    if num_tokens <= 64:
        return 32, 64, max(64, group), 4, 3
    return 64, 64, max(64, group), 4, 3


def split_k(num_programs: int, num_steps: int, num_sms: int) -> int:
    """K splits (a power of two) for num_programs output tiles of num_steps K steps each."""
    split = 1
    while (split < MAX_SPLIT_K and num_programs * split * 2 <= PROGRAMS_PER_SM * num_sms
           and num_steps >= MIN_STEPS_PER_SPLIT * split * 2):
        split *= 2
    return split


def launch_plan(num_tokens: int, n: int, k: int, fmt_name: str, num_sms: int,
                num_splits: int | None = None) -> LaunchPlan:
    """The tiles and K split quant_linear uses for num_tokens rows of a [n, k] weight (None = heuristic)."""
    group = FORMATS[fmt_name][1]
    bm, bn, bk, num_warps, num_stages = tiles(num_tokens, group)
    num_groups, step = k // group, bk // group
    if num_splits is None:
        num_splits = split_k(triton.cdiv(num_tokens, bm) * triton.cdiv(n, bn), triton.cdiv(num_groups, step), num_sms)
    # Each split a whole number of K steps, so no step straddles two splits.
    groups_per_split = triton.cdiv(triton.cdiv(num_groups, num_splits), step) * step
    return LaunchPlan(bm, bn, bk, num_warps, num_stages, num_splits, groups_per_split)


def supports(fmt_name: str, x: torch.Tensor) -> bool:
    """Whether quant_linear runs this format on x's device (CUDA, or CPU under the interpreter)."""
    return fmt_name in FORMATS and (x.device.type == "cuda" or triton_ops.INTERPRETED)


def rows_and_output(x: torch.Tensor, n: int, k: int, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] as unit-stride rows [M, K], and the output [M, n] in x's dtype (both kernels' start)."""
    assert x.shape[-1] == k, f"x has {x.shape[-1]} inputs, the weight {k}"
    assert bias is None or bias.shape == (n,) and bias.stride(0) == 1
    triton_ops._check_device(x)
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2, torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)


def partials(out: torch.Tensor, num_splits: int) -> torch.Tensor:
    """Where a kernel writes: `out`, or float32 partials [num_splits, M, N] when K is split."""
    return out if num_splits == 1 else torch.empty(num_splits, *out.shape, dtype=torch.float32, device=out.device)


def sum_partials(out: torch.Tensor, dest: torch.Tensor, bias: torch.Tensor | None) -> None:
    """out = the partials' sum (+ bias), when dest holds partials (partials() made them)."""
    if dest is not out:
        total = out.numel()
        sum_splits_kernel[(triton.cdiv(total, SUM_SPLITS_BLOCK),)](
            out, dest, bias if bias is not None else out, total, out.shape[1], NUM_SPLITS=dest.shape[0],
            HAS_BIAS=bias is not None, BLOCK=SUM_SPLITS_BLOCK)


def quant_linear(x: torch.Tensor, blocks: torch.Tensor, fmt_name: str, bias: torch.Tensor | None = None, *,
                 num_splits: int | None = None) -> torch.Tensor:
    """engine.quant.reference_linear on Triton: x [..., K] @ dequantize(blocks [N, row bytes])^T + bias,
    in x.dtype. `num_splits` overrides the heuristic (tests use it to reach each path)."""
    kind, group, block, block_bytes = FORMATS[fmt_name]
    n = blocks.shape[0]
    k = blocks.shape[1] // block_bytes * block
    assert blocks.dtype == torch.uint8 and blocks.shape[1] % block_bytes == 0 and blocks.stride(1) == 1
    x2, out = rows_and_output(x, n, k, bias)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    plan = launch_plan(m, n, k, fmt_name, triton_ops._num_sms(x.device), num_splits)
    dest = partials(out, plan.num_splits)
    grid = (triton.cdiv(m, plan.block_m), triton.cdiv(n, plan.block_n), plan.num_splits)
    quant_matmul_kernel[grid](
        x2, blocks, bias if bias is not None else out, dest, m, n, k, plan.groups_per_split,
        x2.stride(0), blocks.stride(0), n, m * n,
        FORMAT=kind, GROUP=group, BLOCK=block, BLOCK_BYTES=block_bytes, HAS_BIAS=bias is not None,
        PARTIAL=dest is not out, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        # float32 is for tests: keep it exact instead of TF32 on tensor cores.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=plan.num_warps, num_stages=plan.num_stages)
    sum_partials(out, dest, bias)
    return out.view(*x.shape[:-1], n)


def warm_shapes(shapes: dict, plan, launch, dtype: torch.dtype, device: torch.device | str,
                max_num_tokens: int) -> int:
    """Per shape (key (format name, n, k, has bias) -> (weight, bias)): one launch(x, format name,
    weight, bias) for each distinct plan(m, n, k, format name, SMs) over m = 1 to max_num_tokens rows (the
    binaries differ by tile, by partial or final output, and by the split length's divisibility).
    Returns the launches made."""
    num_sms = triton_ops._num_sms(torch.device(device))
    launches = 0
    for (fmt_name, n, k, _), (weight, bias) in shapes.items():
        plans = {}
        for m in range(1, max_num_tokens + 1):
            plans.setdefault(plan(m, n, k, fmt_name, num_sms), m)
        for m in plans.values():
            x = torch.zeros(m, k, dtype=dtype, device=device)
            launch(x, fmt_name, weight, None if bias is None else bias.to(dtype))
            launches += 1
    return launches


def warmup(layers, dtype: torch.dtype, device: torch.device | str, max_num_tokens: int) -> int:
    """Compile, before serving, every binary quant_linear can pick for these layers at 1 to
    max_num_tokens rows: `layers` yields (format name, blocks, bias or None); per distinct shape one
    launch for each tile and K-split plan a row count maps to. Returns the launches made."""
    shapes = {}
    for fmt_name, blocks, bias in layers:
        _, _, block, block_bytes = FORMATS[fmt_name]
        n, k = blocks.shape[0], blocks.shape[1] // block_bytes * block
        shapes.setdefault((fmt_name, n, k, bias is not None), (blocks, bias))
    return warm_shapes(shapes, launch_plan, lambda x, fmt_name, blocks, bias: quant_linear(x, blocks, fmt_name, bias),
                       dtype, device, max_num_tokens)
