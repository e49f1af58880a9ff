"""Triton weight-only matmul on GPU-repacked 4- and 8-bit weights: y = x @ dequantize(W)^T (+ bias).

GGUF's 32-weight blocks (Q8_0, Q4_0, Q4_1: engine/quant/formats.py) interleave an fp16 scale (and
min) with 16 or 32 bytes of codes in 18-, 20- or 34-byte blocks. A GPU kernel reading them must
load byte by byte (no block is 4-byte aligned), one load instruction per weight or so: the
tl.dot kernel on them (triton_quant.py) streamed the 4-bit bytes at 0.5 TB/s on an H200, its load
units the bottleneck. So the triton backend repacks them once at load (`pack`), into the layout
GPTQ-style GPU kernels read:

    words  int32 [K / P, N]   P = 32 / BITS codes a word (8 nibbles, or 4 bytes), code j of word r
                              of column n in bits BITS*j.. : weight k = r * P + j of output row n
    scales fp16  [1 or 2, K / 32, N]  the block's d, then (Q4_1) its min m

As many bytes as the blocks (codes, a 16-bit scale, Q4_1's 16-bit min), so the blocks are freed
and the weights' resident size does not change.

Codes are unsigned: a weight is d * u + m with m = -8 d (Q4_0), -128 d (Q8_0: its int8 + 128),
or the block's own min (Q4_1). In float32, d * u is exact (an 11-bit by 8-bit product), so
d * u + m rounds once, as engine.quant's dequantize does; the value is the same.

Consecutive columns' words are adjacent: a warp loads whole 16-byte runs of words, 32 weights a
thread a load. Two kernels read the layout:
- `gemv`: one row (batch-1 decode), on CUDA cores, no tensor-core padding to 16 rows. Each program
  owns BLOCK_N columns and a split of K; per word it accumulates s = sum_j x[k] u_j in float32, and
  applies the block's d * s + m * sum_j x[k] (the scale factored out of the block's sum).
- `dot`: more rows: dequantizes a [BLOCK_K, BLOCK_N] tile to x's dtype and feeds tl.dot.
When K is split, both write float32 partials: `gemv`'s last split of a column tile to finish sums
them (an arrival count a tile, split_counts), `dot`'s are summed by triton_quant.sum_splits_kernel.
Nothing is read back from the GPU: a step calling them can be captured in a CUDA graph.

The one-row kernel streams an int4 weight well below the bandwidth at which cuBLAS reads the bf16
matrix, yet fast enough that a batch-1 decode step runs faster with int4 weights than with bf16,
where the GGUF-block layout ran slower (BENCHMARKS.md, "GPU"). No tile or split target moved the
big shapes much; by a count of ~40 instructions a 32-bit word of codes, instruction throughput
rather than memory is the likely bound (an estimate: not profiled with Nsight Compute yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import triton_ops, triton_quant

# format name -> (bits a code, offset: m = -offset * d; None: the block stores its min)
FORMATS = {"Q8_0": (8, 128.0), "Q4_0": (4, 8.0), "Q4_1": (4, None)}
GROUP_SIZE = 32  # weights a scale covers (a GGUF block)
GROUP = tl.constexpr(GROUP_SIZE)  # the same, for the kernels (a plain global would not compile)
# Split K until this many programs per SM run. 2, with GEMV_TILE below: the best of the tile x split
# target sweeps for a 1B model's four one-row matmuls on an H100 and an H200.
PROGRAMS_PER_SM = 2
MAX_SPLIT_K = 32


@dataclass(frozen=True)
class PackedWeight:
    """A 32-weight block format repacked for the GPU kernels (layout in the module docstring)."""

    words: torch.Tensor  # int32 [K / P, N]
    scales: torch.Tensor  # fp16 [1 or 2, K / 32, N]: d, then (Q4_1) m
    format: str

    @property
    def shape(self) -> tuple[int, int]:
        return self.words.shape[1], self.scales.shape[1] * GROUP_SIZE

    @property
    def nbytes(self) -> int:
        return self.words.numel() * 4 + self.scales.numel() * 2


PACK_ROWS = 4096  # rows repacked at a time: the int64 staging of a 128K-vocabulary head would be GBs


def pack(blocks: torch.Tensor, fmt_name: str) -> PackedWeight:
    """GGUF blocks uint8 [N, K / 32 * block bytes] of a 32-weight format -> PackedWeight, on their device."""
    bits, offset = FORMATS[fmt_name]
    block_bytes = triton_quant.FORMATS[fmt_name][3]
    n, k = blocks.shape[0], blocks.shape[1] // block_bytes * GROUP_SIZE
    per_word = 32 // bits
    words = torch.empty(k // per_word, n, dtype=torch.int32, device=blocks.device)
    scales = torch.empty(1 if offset is not None else 2, k // GROUP_SIZE, n, dtype=torch.float16, device=blocks.device)
    shifts = torch.arange(per_word, device=blocks.device, dtype=torch.int64) * bits
    for start in range(0, n, PACK_ROWS):
        b = blocks[start:start + PACK_ROWS].reshape(-1, k // GROUP_SIZE, block_bytes)
        rows = slice(start, start + b.shape[0])
        scales[0, :, rows] = b[..., 0:2].contiguous().view(torch.float16)[..., 0].t()
        if offset is None:
            scales[1, :, rows] = b[..., 2:4].contiguous().view(torch.float16)[..., 0].t()
        if bits == 4:
            qs = b[..., block_bytes - 16:]
            codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # a block's weights 0..15 low nibbles, 16..31 high
        else:
            codes = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        w = (codes.reshape(b.shape[0], -1, per_word).to(torch.int64) << shifts).sum(-1)  # [rows, K / P], < 2^32
        words[:, rows] = torch.where(w >= 2**31, w - 2**32, w).to(torch.int32).t()
    return PackedWeight(words, scales, fmt_name)


def rows(w: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Output rows `ids` (int64 [n]) of the weight, float32 [n, K]: the repacked blocks' values as
    engine.quant's dequantize gives them (d * u exact in float32, + m rounding once), from the
    repacked copy alone, so a tied embedding looks its rows up here and the blocks can be freed.
    Torch ops: a lookup reads a few rows a step."""
    bits, offset = FORMATS[w.format]
    n, per_word = ids.numel(), 32 // bits
    shifts = torch.arange(per_word, device=w.words.device, dtype=torch.int32) * bits
    codes = (w.words[:, ids].t().unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # the mask drops sign bits
    scales = w.scales[:, :, ids].float().permute(0, 2, 1).repeat_interleave(GROUP_SIZE, dim=2)  # [1|2, n, K]
    d = scales[0]
    m = scales[1] if offset is None else -offset * d
    return d * codes.reshape(n, -1).float() + m


@triton.jit
def _code_products(x_ptrs, w_in, words, j: tl.constexpr, BITS: tl.constexpr, MASKED: tl.constexpr = True):
    """x[k] * u for code j of each word [WORDS, BLOCK_N] (its inputs at x_ptrs + j [WORDS]), and x[k].

    The code is turned into a float without a shift or an int->float convert: masked in place
    (bits BITS*j..), OR'ed under the exponent of 2^23 and 2^23 subtracted, which gives u * 2^(BITS*j)
    exactly while it stays in the 23 mantissa bits (the caller hands codes above bit 15 over as
    words >> 16); x is scaled by 2^-(BITS*j) instead, also exactly. Two ALU ops a code (the mask
    and OR fuse into one LOP3) where a shift, mask and convert take three, one of them slow."""
    if MASKED:
        x = tl.load(x_ptrs + j, mask=w_in, other=0.0).to(tl.float32)
    else:
        x = tl.load(x_ptrs + j).to(tl.float32)
    u = ((words & (((1 << BITS) - 1) << (BITS * j))) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return (x * (1.0 / (1 << (BITS * j))))[:, None] * u, x


@triton.jit
def _block_scales(scales_ptr, groups, cols, mask, N, num_groups, OFFSET: tl.constexpr, HAS_MIN: tl.constexpr,
                  MASKED: tl.constexpr = True):
    """Blocks `groups` [R] of columns `cols`: their d and m (m = -OFFSET d where the format stores
    no min), float32 [R, BLOCK_N] each; masked-off entries 0 (MASKED; else all are read)."""
    ptrs = scales_ptr + groups.to(tl.int64)[:, None] * N + cols[None, :]
    if MASKED:
        d = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    else:
        d = tl.load(ptrs).to(tl.float32)
    if HAS_MIN:
        if MASKED:
            m = tl.load(ptrs + num_groups * N, mask=mask, other=0.0).to(tl.float32)
        else:
            m = tl.load(ptrs + num_groups * N).to(tl.float32)
    else:
        m = -OFFSET * d
    return d, m


@triton.jit
def _word_rows(words_ptr, scales_ptr, wr, cols, mask, N, num_groups, OFFSET: tl.constexpr, HAS_MIN: tl.constexpr,
               WPG: tl.constexpr, MASKED: tl.constexpr):
    """Word rows wr [WORDS] of columns cols (where `mask`, if MASKED): the words, their blocks' d and m."""
    ptrs = words_ptr + wr.to(tl.int64)[:, None] * N + cols[None, :]
    if MASKED:
        words = tl.load(ptrs, mask=mask, other=0)
    else:
        words = tl.load(ptrs)
    d, mn = _block_scales(scales_ptr, wr // WPG, cols, mask, N, num_groups, OFFSET, HAS_MIN, MASKED)
    return words, d, mn


@triton.jit
def _store_row(out_ptr, bias_ptr, y, cols, col_in, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=col_in, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, y.to(out_ptr.dtype.element_ty), mask=col_in)


@triton.jit(do_not_specialize=["stride_split"])
def gemv_kernel(x_ptr, words_ptr, scales_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, K, k_per_split, stride_split,
                BITS: tl.constexpr, OFFSET: tl.constexpr, HAS_MIN: tl.constexpr, HAS_BIAS: tl.constexpr,
                PARTIAL: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr, EVEN: tl.constexpr):
    """One row: out[n] = sum_k x[k] w[n, k] (+ bias), in out's dtype. A step is WORDS word rows
    [WORDS, BLOCK_N], every tensor in the words' layout (a thread's columns adjacent): per word
    s = sum_j x[k] u_j, then acc += d s + m sum_j x[k] (the block's scale factored out of its sum);
    one reduction over the word rows at the end.

    The next step's words and scales are loaded before this step's arithmetic, so a program keeps
    two steps' bytes in flight, which hides a load's latency behind the arithmetic. EVEN (the
    columns fill whole tiles and every split whole steps): no masks, whose predicates and selects
    cost instructions in a kernel that instruction throughput, not memory, likely bounds; the last
    step's look-ahead reads that step's rows again (cache hits) rather than past its split.

    PARTIAL (K split over axis 1): each program writes its float32 partial at part_ptr + split *
    stride_split, then counts itself in at count_ptr[column tile]; the last of the tile's splits to
    arrive sums the partials in split order (the result does not depend on who came last), adds
    the bias, stores, and sets the count back to 0 for the next launch. One launch where a second
    kernel summing the partials cost ~1.5 us a matmul (48 of 64 at batch 1 on a 1B model)."""
    P: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = P // 2  # codes in each 16-bit half of a word
    WPG: tl.constexpr = GROUP // P  # words a block spans
    STEP: tl.constexpr = WORDS * P
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_in = cols < N
    first = tl.program_id(1) * k_per_split
    last = tl.minimum(first + k_per_split, K)
    last_word = last // P
    num_groups = K // GROUP
    wr = first // P + tl.arange(0, WORDS)
    mask = (wr < last_word)[:, None] & col_in[None, :]  # (EVEN: unused, none is needed)
    words, d, mn = _word_rows(words_ptr, scales_ptr, wr, cols, mask, N, num_groups, OFFSET, HAS_MIN, WPG, not EVEN)
    acc = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
    for k0 in range(first, last, STEP):
        x_mask = wr < last_word
        if EVEN:
            ahead = wr + (tl.minimum(k0 + STEP, last - STEP) - k0) // P  # the last step: itself again
        else:
            ahead = wr + WORDS
        mask = (ahead < last_word)[:, None] & col_in[None, :]
        next_words, next_d, next_mn = _word_rows(words_ptr, scales_ptr, ahead, cols, mask, N, num_groups, OFFSET,
                                                 HAS_MIN, WPG, not EVEN)
        high = words >> 16
        x_ptrs = x_ptr + wr * P
        s = tl.zeros((WORDS, BLOCK_N), dtype=tl.float32)
        xs = tl.zeros((WORDS,), dtype=tl.float32)
        for j in tl.static_range(HALF):
            p, x = _code_products(x_ptrs, x_mask, words, j, BITS, not EVEN)
            s += p
            xs += x
            p, x = _code_products(x_ptrs + HALF, x_mask, high, j, BITS, not EVEN)
            s += p
            xs += x
        acc += d * s + mn * xs[:, None]
        wr += WORDS
        words, d, mn = next_words, next_d, next_mn
    finish_row(tl.sum(acc, axis=0), out_ptr, part_ptr, count_ptr, bias_ptr, cols, col_in, stride_split, PARTIAL,
               HAS_BIAS)


@triton.jit
def finish_row(y, out_ptr, part_ptr, count_ptr, bias_ptr, cols, col_in, stride_split, PARTIAL: tl.constexpr,
               HAS_BIAS: tl.constexpr):
    """A one-row program's float32 sums y over its split of K, for columns `cols` (where col_in):
    stored (+ bias) in out's dtype; or, K split over axis 1 (PARTIAL), written as the split's partial,
    and the last of the column tile's splits to arrive (axis 0: the tile) sums the partials in split
    order (the result does not depend on who came last), stores, and sets the tile's count back to 0
    for the next launch."""
    if PARTIAL:
        tile = tl.program_id(0)
        tl.store(part_ptr + tl.program_id(1).to(tl.int64) * stride_split + cols, y, mask=col_in)
        tl.debug_barrier()  # every thread's partial stored before the count says so (release below)
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == tl.num_programs(1) - 1:
            y = tl.zeros_like(y)
            for split in range(0, tl.num_programs(1)):
                y += tl.load(part_ptr + split * stride_split + cols, mask=col_in, other=0.0, cache_modifier=".cg")
            _store_row(out_ptr, bias_ptr, y, cols, col_in, HAS_BIAS)
            tl.atomic_xchg(count_ptr + tile, 0)
    else:
        _store_row(out_ptr, bias_ptr, y, cols, col_in, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "stride_split"])
def dot_kernel(x_ptr, words_ptr, scales_ptr, bias_ptr, out_ptr, M, N, K, k_per_split, stride_x, stride_out,
               stride_split, BITS: tl.constexpr, OFFSET: tl.constexpr, HAS_MIN: tl.constexpr,
               HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               WORDS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """As gemv_kernel, on tensor cores: BLOCK_M rows (>= 16) a program, the weight tile dequantized
    to x's dtype (as engine.quant rounds it) for tl.dot."""
    P: tl.constexpr = 32 // BITS
    WPG: tl.constexpr = GROUP // P
    G: tl.constexpr = WORDS // WPG  # blocks a step
    BLOCK_K: tl.constexpr = WORDS * P
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in, col_in = rows < M, cols < N
    first = tl.program_id(2) * k_per_split
    last = tl.minimum(first + k_per_split, K)
    num_groups = K // GROUP
    shifts = (tl.arange(0, P) * BITS)[None, None, :, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(first, last, BLOCK_K):
        g = k0 // GROUP + tl.arange(0, G)
        g_in = g < last // GROUP
        wr = (g * WPG)[:, None] + tl.arange(0, WPG)[None, :]  # [G, WPG]
        words = tl.load(words_ptr + wr.to(tl.int64)[:, :, None] * N + cols[None, None, :],
                        mask=g_in[:, None, None] & col_in[None, None, :], other=0)
        u = ((words[:, :, None, :] >> shifts) & ((1 << BITS) - 1)).to(tl.float32)  # [G, WPG, P, BLOCK_N]
        d, mn = _block_scales(scales_ptr, g, cols, g_in[:, None] & col_in[None, :], N, num_groups, OFFSET, HAS_MIN)
        w = d[:, None, None, :] * u + mn[:, None, None, :]
        w = tl.reshape(w, (BLOCK_K, BLOCK_N)).to(x_ptr.dtype.element_ty)
        k_in = k0 + tl.arange(0, BLOCK_K) < last
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + (k0 + tl.arange(0, BLOCK_K))[None, :],
                    mask=row_in[:, None] & k_in[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    triton_quant.store_tile(out_ptr, bias_ptr, acc, rows, cols, row_in, col_in, stride_out, stride_split, PARTIAL,
                            HAS_BIAS)


@dataclass(frozen=True)
class LaunchPlan:
    kernel: str  # "gemv" or "dot"
    block_m: int
    block_n: int
    words: int  # word rows a K step
    num_warps: int
    num_stages: int
    num_splits: int
    k_per_split: int  # weights of K a split covers: whole steps


GEMV_MAX_ROWS = 1  # rows the CUDA-core kernel takes; more go to tensor cores
# The CUDA-core kernel's tile: (BLOCK_N, word rows a step, num_warps, num_stages); in word rows so
# that a thread holds as many words (16) in either format: a step is 512 weights of K at 4 bits,
# 256 at 8. Narrow column tiles and long K steps, because they were the best of 32 tiles x split
# targets in H200 sweeps of a 1B layer's four one-row matmuls, well ahead of the tensor-core
# kernel's 16-row tile (python benchmarks/gpu/packed_bench.py --sweep).
GEMV_TILE = (32, 64, 4, 2)


def tiles(num_tokens: int, bits: int) -> tuple[str, int, int, int, int, int]:
    """(kernel, BLOCK_M, BLOCK_N, WORDS, num_warps, num_stages) for num_tokens rows."""
    per_word = 32 // bits
    if num_tokens <= GEMV_MAX_ROWS:
        block_n, words, num_warps, num_stages = GEMV_TILE
        return "gemv", 1, block_n, words, num_warps, num_stages
    if num_tokens <= 16:
        return "dot", 16, 64, 128 // per_word, 4, 3
    if num_tokens <= 64:
        return "dot", 32, 64, 64 // per_word, 4, 3
    return "dot", 64, 64, 64 // per_word, 4, 3


def launch_plan(num_tokens: int, n: int, k: int, fmt_name: str, num_sms: int, *, num_splits: int | None = None,
                config: tuple | None = None) -> LaunchPlan:
    """The kernel, tiles and K split for num_tokens rows of an [n, k] packed weight (config: a
    tiles() tuple to use instead, for benches)."""
    bits = FORMATS[fmt_name][0]
    kernel, bm, bn, words, num_warps, num_stages = config or tiles(num_tokens, bits)
    step = words * (32 // bits)
    num_steps = triton.cdiv(k, step)
    if num_splits is None:
        programs = triton.cdiv(num_tokens, bm) * triton.cdiv(n, bn)
        num_splits = 1
        while (num_splits < MAX_SPLIT_K and programs * num_splits * 2 <= PROGRAMS_PER_SM * num_sms
               and num_steps >= num_splits * 2):
            num_splits *= 2
    k_per_split = triton.cdiv(num_steps, num_splits) * step
    return LaunchPlan(kernel, bm, bn, words, num_warps, num_stages, num_splits, k_per_split)


def packed_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None, *,
                  num_splits: int | None = None, config: tuple | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(w)^T + bias in x.dtype (engine.quant.reference_linear's values
    within float32 accumulation). num_splits / config override the heuristics (tests, benches)."""
    bits, offset = FORMATS[w.format]
    n, k = w.shape
    x2, out = triton_quant.rows_and_output(x, n, k, bias)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    plan = launch_plan(m, n, k, w.format, triton_ops._num_sms(x.device), num_splits=num_splits, config=config)
    dest = triton_quant.partials(out, plan.num_splits)
    partial = dest is not out
    bias_arg = bias if bias is not None else out
    meta = dict(BITS=bits, OFFSET=offset or 0.0, HAS_MIN=offset is None, HAS_BIAS=bias is not None,
                PARTIAL=partial, BLOCK_N=plan.block_n, WORDS=plan.words, num_warps=plan.num_warps,
                num_stages=plan.num_stages)
    if plan.kernel == "gemv":
        assert m == 1, "the CUDA-core kernel takes one row"
        tiles_n = triton.cdiv(n, plan.block_n)
        step = plan.words * (32 // bits)
        even = n % plan.block_n == 0 and plan.k_per_split % step == 0 and plan.k_per_split * plan.num_splits == k
        gemv_kernel[(tiles_n, plan.num_splits)](
            x2, w.words, w.scales, bias_arg, out, dest, split_counts(out.device, tiles_n) if partial else out,
            n, k, plan.k_per_split, n, EVEN=even, **meta)
        return out.view(*x.shape[:-1], n)
    grid = (triton.cdiv(m, plan.block_m), triton.cdiv(n, plan.block_n), plan.num_splits)
    dot_kernel[grid](x2, w.words, w.scales, bias_arg, dest, m, n, k, plan.k_per_split, x2.stride(0), n, m * n,
                     BLOCK_M=plan.block_m, **meta,
                     # float32 is for tests: keep it exact instead of TF32 on tensor cores
                     DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    triton_quant.sum_partials(out, dest, bias)
    return out.view(*x.shape[:-1], n)


_split_counts: dict[tuple, torch.Tensor] = {}


def split_counts(device: torch.device, tiles: int) -> torch.Tensor:
    """gemv_kernel's arrival counts, one int32 a column tile, zero between launches (the last
    split of each tile resets its count). One buffer per device and stream: launches on one stream
    run one after another, so they never share a count; a CUDA graph keeps the capture stream's
    buffer (made zero during the capture, at its first launch there), and graphs replayed one
    after another (an engine's steps) share it as safely. Grown when a launch has more column
    tiles than it holds, never shrunk."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    counts = _split_counts.get(key)
    if counts is None or counts.numel() < tiles:
        counts = _split_counts[key] = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
    return counts


def warmup(layers, dtype: torch.dtype, device: torch.device | str, max_num_tokens: int) -> int:
    """Compile, before serving, every binary packed_linear can pick for these layers at 1 to
    max_num_tokens rows: `layers` yields (PackedWeight, bias or None); per distinct shape one launch
    for each launch plan a row count maps to. Returns the launches made."""
    shapes = {}
    for w, bias in layers:
        shapes.setdefault((w.format, *w.shape, bias is not None), (w, bias))
    return triton_quant.warm_shapes(shapes, launch_plan, lambda x, fmt_name, w, bias: packed_linear(x, w, bias),
                                    dtype, device, max_num_tokens)
