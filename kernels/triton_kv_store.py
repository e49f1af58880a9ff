"""Triton KV store: write each new token's key and value into its cache slot.

One program per token moves all its KV heads ([num_kv_heads, head_dim] for K and for V) in one
masked tile: a single token's head is only head_dim elements, too little work for a program.
An fp8 (e4m3) cache stores x / scale in float32, saturated to +-448, rounded to nearest even, as
kernels/reference.py's quantize_kv does.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round_to_e4m3(x):
    """float32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even, still float32. The
    cast to fp8 after it is then exact on every target: Triton's interpreter rounds its fp8 casts
    half up and loses the carry into the exponent. The same steps as torch's own conversion."""
    x_bits = x.to(tl.int32, bitcast=True)
    magnitude = tl.abs(x)
    bits = magnitude.to(tl.int32, bitcast=True)
    # Normal e4m3: keep 3 of float's 23 mantissa bits, rounding the 20 dropped ones to nearest even
    # (a carry out of the mantissa moves into the exponent, as it should).
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    # Subnormal e4m3 (below 2^-6) sits on a grid of 2^-9: float32's own grid at 2^14, so adding
    # 2^14 rounds there (to nearest even) and subtracting it is exact.
    subnormal = (magnitude + 16384.0) - 16384.0
    rounded = tl.where(magnitude < 0.015625, subnormal, normal).to(tl.int32, bitcast=True)
    return (rounded | ((x_bits >> 31) << 31)).to(tl.float32, bitcast=True)  # the sign back, -0 included


@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])  # may be a view into a staging buffer
def write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                    stride_key_tok, stride_key_head, stride_value_tok, stride_value_head,
                    stride_k_blk, stride_k_slot, stride_k_head, stride_v_blk, stride_v_slot, stride_v_head,
                    k_scale, v_scale,
                    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    FP8: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return  # padding token: it owns no slot
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + tok * stride_key_tok + heads * stride_key_head + dims, mask=mask)
    v = tl.load(value_ptr + tok * stride_value_tok + heads * stride_value_head + dims, mask=mask)
    if FP8:
        # div_rn: a correctly rounded division, as torch's (plain `/` on CUDA is approximate).
        k = _round_to_e4m3(tl.clamp(tl.math.div_rn(k.to(tl.float32), k_scale), -448.0, 448.0))
        v = _round_to_e4m3(tl.clamp(tl.math.div_rn(v.to(tl.float32), v_scale), -448.0, 448.0))
    tl.store(k_cache_ptr + block * stride_k_blk + offset * stride_k_slot + heads * stride_k_head + dims,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_v_blk + offset * stride_v_slot + heads * stride_v_head + dims,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)
