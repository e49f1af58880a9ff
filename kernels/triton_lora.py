"""Triton multi-LoRA shrink and expand, BGMV-style: each program reads its own token's adapter slot
and multiplies that token's row by that adapter's weights, so tokens of many adapters (and of the
base model, slot -1) share one launch with no sorting or grouping on the host. kernels/reference.py
defines both ops.

  shrink  grid (tokens, blocks of BLOCK_N rows of A): buf[t, rows] = A[slot, rows] @ x[t], float32,
          K walked in BLOCK_K steps; slot -1 stores zeros.
  expand  grid (tokens, blocks of BLOCK_M output columns): each column finds its slice (up to
          MAX_SLICES boundaries are scalar arguments, so no tensor describes the slices), reads that
          slice's R values of buf and its row of B, and adds the float32 sum, rounded to y's dtype,
          to y; slot -1 returns at once, leaving y's row as it was.
Past TILED_TOKENS tokens (prefill chunks) a program of either op takes a tile of TILE_TOKENS
consecutive tokens instead, one tl.dot per slot present in it: a prefill chunk's tokens are one
request's, so a tile is mostly one slot, and the weights are read once per tile rather than once
per token. The expand's dot is float32 ("ieee"), as buf is.

Ranks need not be powers of two: the rank is padded to R_PAD lanes under a mask. The token count
is the grid (or, tiled, an argument that is not specialised), so a new batch size never compiles a
new binary; every other size that is an argument is a model constant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SLICES = 4  # slices one expand launch handles; a projection with more takes a launch per group
BLOCK_N = 16
BLOCK_M = 64
TILED_TOKENS = 64  # more tokens than this (prefill chunks) take the tiled kernels
# Small tiles: with 16 tokens and 16 rows of A a tile, a 512-token chunk of a q/k/v projection is 96
# programs, each reading A's rows once for 16 tokens; bigger tiles left most of a GPU's SMs idle.
TILE_TOKENS = 16


@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])  # may be a view into a staging buffer
def lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, buf_ptr, stride_x,
                       K: tl.constexpr, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if slot >= 0:
        a_rows = a_ptr + slot * (N * K) + rows[:, None].to(tl.int64) * K
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_mask = cols < K
            x = tl.load(x_ptr + tok * stride_x + cols, mask=col_mask, other=0.0).to(tl.float32)
            a = tl.load(a_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(buf_ptr + tok * N + rows, acc, mask=row_mask)


@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["slots_ptr"])
def lora_shrink_tiled_kernel(x_ptr, a_ptr, slots_ptr, buf_ptr, num_tokens, stride_x,
                             K: tl.constexpr, N: tl.constexpr, TILE_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    toks = tl.program_id(0) * TILE_TOKENS + tl.arange(0, TILE_TOKENS)
    tok_mask = toks < num_tokens
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    slots = tl.load(slots_ptr + toks, mask=tok_mask, other=-1)
    first = tl.maximum(tl.min(tl.where(tok_mask, slots, 2**30)), 0)
    last = tl.max(slots)
    acc = tl.zeros([TILE_TOKENS, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + toks[:, None].to(tl.int64) * stride_x
    for slot in range(first, last + 1):  # each slot of the tile's tokens (slot -1's rows stay zero)
        mine = tok_mask & (slots == slot)
        if tl.sum(mine.to(tl.int32)) > 0:
            a_rows = a_ptr + (rows[:, None].to(tl.int64) + slot * N) * K
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                col_mask = cols < K
                x = tl.load(x_rows + cols[None, :], mask=mine[:, None] & col_mask[None, :], other=0.0)
                a = tl.load(a_rows + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
                acc = tl.dot(x, tl.trans(a), acc, input_precision=DOT_PRECISION)
    tl.store(buf_ptr + toks[:, None].to(tl.int64) * N + rows[None, :], acc, mask=tok_mask[:, None] & row_mask[None, :])


@triton.jit
def _slice_of(cols, bound1, bound2, bound3, NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr):
    """Which of up to 4 output slices each column falls in (`boundN`: where slice N starts)."""
    part = tl.zeros([BLOCK_M], dtype=tl.int32)
    if NUM_SLICES > 1:
        part += (cols >= bound1).to(tl.int32)
    if NUM_SLICES > 2:
        part += (cols >= bound2).to(tl.int32)
    if NUM_SLICES > 3:
        part += (cols >= bound3).to(tl.int32)
    return part


@triton.jit(do_not_specialize_on_alignment=["slots_ptr"])
def lora_expand_kernel(y_ptr, buf_ptr, b_ptr, slots_ptr, stride_y, stride_buf, stride_b,
                       bound1, bound2, bound3,
                       M: tl.constexpr, R: tl.constexpr, NUM_SLICES: tl.constexpr,
                       BLOCK_M: tl.constexpr, R_PAD: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    if slot < 0:
        return  # a token of the base model: its row of y stays as it was
    cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_mask = cols < M
    part = _slice_of(cols, bound1, bound2, bound3, NUM_SLICES, BLOCK_M)  # each column's slice
    ranks = tl.arange(0, R_PAD)
    mask = col_mask[:, None] & (ranks < R)[None, :]
    v = tl.load(buf_ptr + tok * stride_buf + part[:, None] * R + ranks[None, :], mask=mask, other=0.0)
    b = tl.load(b_ptr + slot * stride_b + cols[:, None].to(tl.int64) * R + ranks[None, :], mask=mask, other=0.0)
    delta = tl.sum(b.to(tl.float32) * v, axis=1)
    y_ptrs = y_ptr + tok * stride_y + cols
    y = tl.load(y_ptrs, mask=col_mask)
    dtype = y_ptr.dtype.element_ty
    tl.store(y_ptrs, (y.to(tl.float32) + delta.to(dtype).to(tl.float32)).to(dtype), mask=col_mask)


@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["slots_ptr"])
def lora_expand_tiled_kernel(y_ptr, buf_ptr, b_ptr, slots_ptr, num_tokens, stride_y, stride_buf, stride_b,
                             bound1, bound2, bound3,
                             M: tl.constexpr, R: tl.constexpr, NUM_SLICES: tl.constexpr, TILE_TOKENS: tl.constexpr,
                             BLOCK_M: tl.constexpr, R_PAD: tl.constexpr):
    toks = tl.program_id(0) * TILE_TOKENS + tl.arange(0, TILE_TOKENS)
    tok_mask = toks < num_tokens
    slots = tl.load(slots_ptr + toks, mask=tok_mask, other=-1)
    first = tl.maximum(tl.min(tl.where(tok_mask, slots, 2**30)), 0)
    last = tl.max(slots)
    cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    col_mask = cols < M
    part = _slice_of(cols, bound1, bound2, bound3, NUM_SLICES, BLOCK_M)  # each column's slice
    ranks = tl.arange(0, R_PAD)
    rank_mask = ranks < R
    acc = tl.zeros([TILE_TOKENS, BLOCK_M], dtype=tl.float32)
    buf_rows = buf_ptr + toks[:, None].to(tl.int64) * stride_buf
    for slot in range(first, last + 1):  # each slot of the tile's tokens
        mine = tok_mask & (slots == slot)
        if tl.sum(mine.to(tl.int32)) > 0:
            b_rows = b_ptr + slot * stride_b + cols[:, None].to(tl.int64) * R + ranks[None, :]
            for i in tl.static_range(NUM_SLICES):  # B's columns of slice i against buf's R values of slice i
                v = tl.load(buf_rows + i * R + ranks[None, :], mask=mine[:, None] & rank_mask[None, :], other=0.0)
                b = tl.load(b_rows, mask=(col_mask & (part == i))[:, None] & rank_mask[None, :], other=0.0)
                acc = tl.dot(v, tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    out_mask = (tok_mask & (slots >= 0))[:, None] & col_mask[None, :]  # rows of slot -1 are not written
    y_ptrs = y_ptr + toks[:, None].to(tl.int64) * stride_y + cols[None, :]
    y = tl.load(y_ptrs, mask=out_mask)
    dtype = y_ptr.dtype.element_ty
    tl.store(y_ptrs, (y.to(tl.float32) + acc.to(dtype).to(tl.float32)).to(dtype), mask=out_mask)


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    tokens, k = x.shape
    n = lora_a.shape[1]
    assert x.stride(1) == 1 and lora_a.is_contiguous() and lora_a.shape[2] == k
    buf = torch.empty(tokens, n, dtype=torch.float32, device=x.device)
    if tokens > TILED_TOKENS and n:
        grid = (triton.cdiv(tokens, TILE_TOKENS), triton.cdiv(n, BLOCK_N))
        lora_shrink_tiled_kernel[grid](x, lora_a, token_slots, buf, tokens, x.stride(0), K=k, N=n,
                                       TILE_TOKENS=TILE_TOKENS, BLOCK_N=BLOCK_N,
                                       BLOCK_K=min(128, max(16, triton.next_power_of_2(k))),
                                       DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    elif tokens and n:
        block_k = min(256, triton.next_power_of_2(k))
        lora_shrink_kernel[(tokens, triton.cdiv(n, BLOCK_N))](x, lora_a, token_slots, buf, x.stride(0),
                                                              K=k, N=n, BLOCK_N=BLOCK_N, BLOCK_K=block_k)
    return buf


def lora_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
                out_slices: tuple[int, ...]) -> None:
    rank = lora_b.shape[2]
    assert y.stride(1) == 1 and lora_b.is_contiguous() and buf.is_contiguous()
    assert sum(out_slices) == y.shape[1] == lora_b.shape[1] and len(out_slices) * rank == buf.shape[1]
    if not y.shape[0] or not rank:
        return
    offset = 0
    for first in range(0, len(out_slices), MAX_SLICES):
        group = out_slices[first:first + MAX_SLICES]
        width = sum(group)
        bounds = [sum(group[:i]) for i in range(1, MAX_SLICES)]
        # Column views of this group: y's and B's rows keep their strides, buf's columns start at the group's.
        y_part, b_part = y[:, offset:offset + width], lora_b[:, offset:offset + width]
        buf_part = buf[:, first * rank:]
        if width and y.shape[0] > TILED_TOKENS:
            lora_expand_tiled_kernel[(triton.cdiv(y.shape[0], TILE_TOKENS), triton.cdiv(width, BLOCK_M))](
                y_part, buf_part, b_part, token_slots, y.shape[0], y.stride(0), buf.stride(0), lora_b.stride(0),
                *bounds, M=width, R=rank, NUM_SLICES=len(group), TILE_TOKENS=TILE_TOKENS, BLOCK_M=BLOCK_M,
                R_PAD=max(16, triton.next_power_of_2(rank)))  # tl.dot's inner size is at least 16
        elif width:
            lora_expand_kernel[(y.shape[0], triton.cdiv(width, BLOCK_M))](
                y_part, buf_part, b_part, token_slots, y.stride(0), buf.stride(0), lora_b.stride(0), *bounds,
                M=width, R=rank, NUM_SLICES=len(group), BLOCK_M=BLOCK_M, R_PAD=triton.next_power_of_2(rank))
        offset += width
