"""Triton fused elementwise kernels around the matmuls: residual-add + RMSNorm, rotary + KV store,
SiLU-and-mul. Each replaces several torch kernels (RMSNorm alone is 8-9 of them) with one launch.

They compute in float32 and round to the model's dtype wherever kernels/reference.py (transformers'
eager code) rounds a 16-bit intermediate, so a 16-bit model sees the reference's values up to the
float32 ulps of a different summation order or exp; float32 sees the same arithmetic.

No token count is a kernel argument (it is the grid), so a new batch size never recompiles them;
every other size is a model constant. Host side: kernels/triton_ops.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton_kv_store import _round_to_e4m3


@triton.jit
def rms_norm_kernel(out_ptr, residual_out_ptr, x_ptr, residual_ptr, weight_ptr, eps,
                    rows_inner, stride_x_outer, stride_x_inner, stride_r_outer, stride_r_inner,
                    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """One row: x (+ residual, rounded to x's dtype and stored as the new residual), then
    weight * (x * rsqrt(mean(x^2) + eps) rounded to x's dtype). Rows are [outer, inner] pairs so a
    head-strided [tokens, heads, head_dim] view (Qwen3's q/k norm) needs no copy."""
    row = tl.program_id(0).to(tl.int64)
    outer, inner = row // rows_inner, row % rows_inner
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + outer * stride_r_outer + inner * stride_r_inner + cols, mask=mask, other=0.0)
        x = (x + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the sum exists in the model's dtype
        tl.store(residual_out_ptr + row * HIDDEN + cols, x, mask=mask)
        x = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / HIDDEN + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * inv).to(x_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * HIDDEN + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate(x1, x2, c, s, DTYPE: tl.constexpr):
    """(x1 c - x2 s, x2 c + x1 s), each product and result rounded to DTYPE as torch's ops round."""
    a = (x1 * c).to(DTYPE).to(tl.float32) - (x2 * s).to(DTYPE).to(tl.float32)
    b = (x2 * c).to(DTYPE).to(tl.float32) + (x1 * s).to(DTYPE).to(tl.float32)
    return a.to(DTYPE), b.to(DTYPE)


@triton.jit
def _store_kv(cache_ptr, block, offset, head, dims, x, scale, mask, stride_blk, stride_slot, stride_head,
              FP8: tl.constexpr):
    """One half of a head's row into its cache slot, as triton_kv_store.write_kv_kernel stores it."""
    if FP8:
        x = _round_to_e4m3(tl.clamp(tl.math.div_rn(x.to(tl.float32), scale), -448.0, 448.0))
    tl.store(cache_ptr + block * stride_blk + offset * stride_slot + head * stride_head + dims,
             x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])  # may be a view into a staging buffer
def rotary_write_kv_kernel(qk_ptr, value_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                           stride_qk_tok, stride_qk_head, stride_value_tok, stride_value_head, stride_cos_tok,
                           stride_sin_tok, stride_k_blk, stride_k_slot, stride_k_head,
                           stride_v_blk, stride_v_slot, stride_v_head, k_scale, v_scale,
                           NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                           HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                           WRITE_KV: tl.constexpr, FP8: tl.constexpr):
    """BLOCK_H heads of one token, counted over [query heads | key heads | value heads]: rotate the
    query and key heads of qk in place (neox halves), and with WRITE_KV store the rotated keys and
    the values at the token's slot (slot -1 = padding: rotated, not stored)."""
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    dim_valid = dims < HALF
    rotated = heads < NUM_HEADS + NUM_KV_HEADS
    dtype = qk_ptr.dtype.element_ty

    c = tl.load(cos_ptr + tok * stride_cos_tok + dims, mask=dim_valid, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + tok * stride_sin_tok + dims, mask=dim_valid, other=0.0).to(tl.float32)
    ptr = qk_ptr + tok * stride_qk_tok + heads * stride_qk_head + dims
    mask = rotated & dim_valid
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = _rotate(x1, x2, c, s, dtype)
    tl.store(ptr, o1, mask=mask)
    tl.store(ptr + HALF, o2, mask=mask)

    if WRITE_KV:
        slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
        if slot >= 0:
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            key_mask = mask & (heads >= NUM_HEADS)
            key_head = heads - NUM_HEADS
            _store_kv(k_cache_ptr, block, offset, key_head, dims, o1, k_scale, key_mask,
                      stride_k_blk, stride_k_slot, stride_k_head, FP8)
            _store_kv(k_cache_ptr, block, offset, key_head, dims + HALF, o2, k_scale, key_mask,
                      stride_k_blk, stride_k_slot, stride_k_head, FP8)
            value_head = heads - NUM_HEADS - NUM_KV_HEADS
            value_mask = (value_head >= 0) & (value_head < NUM_KV_HEADS) & dim_valid
            v_row = value_ptr + tok * stride_value_tok + value_head * stride_value_head + dims
            v1 = tl.load(v_row, mask=value_mask)
            v2 = tl.load(v_row + HALF, mask=value_mask)
            _store_kv(v_cache_ptr, block, offset, value_head, dims, v1, v_scale, value_mask,
                      stride_v_blk, stride_v_slot, stride_v_head, FP8)
            _store_kv(v_cache_ptr, block, offset, value_head, dims + HALF, v2, v_scale, value_mask,
                      stride_v_blk, stride_v_slot, stride_v_head, FP8)


@triton.jit
def silu_and_mul_kernel(out_ptr, x_ptr, stride_x_tok, stride_o_tok, INTER: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, i] = silu(x[t, i]) * x[t, INTER + i] for BLOCK columns of one token, silu rounded to
    the model's dtype first as torch's two ops round."""
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    row = x_ptr + tok * stride_x_tok
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + tok * stride_o_tok + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)
