"""Triton KV store (and the block copy) against kernels/reference.py.

The caches start NaN-poisoned: after a write, exactly the addressed slots hold the new keys and
values, and every other slot, padded tokens' (-1) included, is still NaN.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference
from tests.kernels.kernel_cases import DEVICE, DTYPES


def poisoned_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
            torch.full(shape, float("nan"), dtype=dtype, device=DEVICE))


def new_tokens(num_tokens, num_kv_heads, head_dim, dtype, strided, seed):
    gen = torch.Generator().manual_seed(seed)
    # A strided key/value is a slice of a fused qkv tensor, as the attention layer produces.
    width = 3 * num_kv_heads if strided else num_kv_heads
    kv = torch.randn(num_tokens, 2, width, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    return kv[:, 0, :num_kv_heads], kv[:, 1, :num_kv_heads]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 64, 16), (2, 80, 32), (3, 128, 16), (8, 256, 32)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_write_kv_touches_exactly_the_addressed_slots(triton_ops, dtype, num_kv_heads, head_dim, block_size,
                                                      index_dtype):
    num_blocks, num_tokens = 6, 13
    gen = torch.Generator().manual_seed(head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7, 12]] = -1  # padding tokens, the last one included
    slot_mapping = slots.to(dtype=index_dtype, device=DEVICE)
    key, value = new_tokens(num_tokens, num_kv_heads, head_dim, dtype, strided=head_dim == 80, seed=head_dim)

    k_cache, v_cache = poisoned_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    triton_ops.write_kv(key, value, k_cache, v_cache, slot_mapping)

    k_flat, v_flat = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    real = slots >= 0
    written = slots[real].to(DEVICE)
    assert torch.equal(k_flat[written], key[real.to(DEVICE)])
    assert torch.equal(v_flat[written], value[real.to(DEVICE)])
    untouched = torch.ones(k_flat.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert k_flat[untouched].isnan().all() and v_flat[untouched].isnan().all()

    k_ref, v_ref = poisoned_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    reference.write_kv(key, value, k_ref, v_ref, slot_mapping)
    assert torch.equal(k_cache.nan_to_num(), k_ref.nan_to_num())
    assert torch.equal(v_cache.nan_to_num(), v_ref.nan_to_num())


def test_write_kv_casts_to_the_cache_dtype(triton_ops):
    key, value = new_tokens(5, 2, 64, torch.float32, strided=False, seed=1)
    k_cache, v_cache = poisoned_cache(2, 16, 2, 64, torch.float16)
    slot_mapping = torch.tensor([3, 17, -1, 0, 31], device=DEVICE)
    triton_ops.write_kv(key, value, k_cache, v_cache, slot_mapping)
    k_ref, v_ref = poisoned_cache(2, 16, 2, 64, torch.float16)
    reference.write_kv(key, value, k_ref, v_ref, slot_mapping)
    assert torch.equal(k_cache.nan_to_num(), k_ref.nan_to_num())
    assert torch.equal(v_cache.nan_to_num(), v_ref.nan_to_num())


def test_write_kv_all_padding_and_empty(triton_ops):
    key, value = new_tokens(4, 2, 64, torch.float16, strided=False, seed=2)
    k_cache, v_cache = poisoned_cache(2, 16, 2, 64, torch.float16)
    triton_ops.write_kv(key, value, k_cache, v_cache, torch.full((4,), -1, device=DEVICE))
    triton_ops.write_kv(key[:0], value[:0], k_cache, v_cache, torch.empty(0, dtype=torch.long, device=DEVICE))
    assert k_cache.isnan().all() and v_cache.isnan().all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_copy_blocks(triton_ops, backend):
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(5, 16, 2, 64, generator=gen).to(DEVICE)
    v_cache = torch.randn(5, 16, 2, 64, generator=gen).to(DEVICE)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    src, dst = torch.tensor([4, 1], device=DEVICE), torch.tensor([0, 3], device=DEVICE)
    kernels.copy_blocks(k_cache, v_cache, src, dst, backend=backend)
    for s, d in ((4, 0), (1, 3)):
        assert torch.equal(k_cache[d], k_before[s]) and torch.equal(v_cache[d], v_before[s])
    for b in (1, 2, 4):
        assert torch.equal(k_cache[b], k_before[b]) and torch.equal(v_cache[b], v_before[b])
