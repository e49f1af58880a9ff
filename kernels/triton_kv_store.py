"""Triton KV store: write each new token's key and value into its cache slot.

One program per token moves all its KV heads ([num_kv_heads, head_dim] for K and for V) in one
masked tile: a single token's head is only head_dim elements, too little work for a program.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                    stride_key_tok, stride_key_head, stride_value_tok, stride_value_head,
                    stride_k_blk, stride_k_slot, stride_k_head, stride_v_blk, stride_v_slot, stride_v_head,
                    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
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
    tl.store(k_cache_ptr + block * stride_k_blk + offset * stride_k_slot + heads * stride_k_head + dims,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_v_blk + offset * stride_v_slot + heads * stride_v_head + dims,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)
