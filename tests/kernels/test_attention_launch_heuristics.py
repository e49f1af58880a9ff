"""Tile and split-KV choices (kernels/triton_heuristics.py) and that the launcher follows them."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels import reference
from kernels.triton_heuristics import MAX_SPLITS, MIN_KEYS_PER_SPLIT, num_kv_splits, tile_config
from tests.kernels.kernel_cases import check_attention, make_batch

H100_SMS = 132


def test_small_batch_long_context_splits():
    assert num_kv_splits(1 * 8, 8192, H100_SMS) == 32  # batch 1, 8 KV heads: 8 programs on 132 SMs
    assert num_kv_splits(16 * 8, 2048, H100_SMS) == 4  # 128 programs: just under one per SM


def test_full_machine_or_short_context_does_not_split():
    assert num_kv_splits(64 * 8, 8192, H100_SMS) == 1
    assert num_kv_splits(1 * 8, 2 * MIN_KEYS_PER_SPLIT - 1, H100_SMS) == 1


@settings(max_examples=200, deadline=None)
@given(busy=st.integers(1, 4096), context=st.integers(1, 1 << 17), sms=st.integers(1, 200))
def test_splits_are_bounded_powers_of_two(busy, context, sms):
    n = num_kv_splits(busy, context, sms)
    assert 1 <= n <= MAX_SPLITS and n & (n - 1) == 0
    assert n == 1 or (busy < sms and context // n >= MIN_KEYS_PER_SPLIT)


def test_tiles():
    decode = tile_config(num_tokens=64, num_seqs=64, group=8, head_dim_pad=128)
    prefill = tile_config(num_tokens=4096, num_seqs=2, group=8, head_dim_pad=128)
    assert (decode.block_m, decode.block_n) == (16, 64)
    assert (prefill.block_m, prefill.block_n) == (128, 64)
    assert tile_config(4096, 2, 4, 256).block_n == 32  # d=256 halves tiles to fit shared memory
    assert tile_config(1, 1, 32, 128).block_m == 32  # a tile always holds a whole head group


HOPPER_SMEM, AMPERE_SMEM = 232448, 166912  # shared_memory_per_block_optin of an H100/H200 and an A100


def test_decode_takes_128_keys_a_step_where_three_stages_fit_in_shared_memory():
    def decode_block_n(head_dim_pad, kv_bytes, smem):
        return tile_config(16, 16, 4, head_dim_pad, kv_bytes, smem).block_n

    assert decode_block_n(128, 2, HOPPER_SMEM) == 128  # bf16: 3 x (K + V) x 32 KiB = 192 KiB
    assert decode_block_n(128, 1, AMPERE_SMEM) == 128  # an fp8 cache halves that
    assert decode_block_n(128, 2, AMPERE_SMEM) == 64
    assert decode_block_n(128, 4, HOPPER_SMEM) == 64  # a float32 cache would need 384 KiB
    assert decode_block_n(256, 2, HOPPER_SMEM) == 32
    assert decode_block_n(128, 2, None) == 64  # unknown shared memory (the interpreter): the small tile
    assert tile_config(4096, 2, 4, 128, 2, HOPPER_SMEM).block_n == 64  # prefill tiles are not affected


def test_launcher_splits_by_the_block_table_width(triton_ops, monkeypatch):
    chosen = []

    def spy(busy, context, sms):
        chosen.append((busy, context, num_kv_splits(busy, context, sms)))
        return chosen[-1][2]

    monkeypatch.setattr(triton_ops, "_num_sms", lambda device: H100_SMS)
    monkeypatch.setattr(triton_ops, "num_kv_splits", spy)
    b = make_batch([1], [600], num_kv_heads=2, group=2, dtype=torch.float16)
    out = kernels.paged_attention(*b.args(), backend="triton")
    assert chosen == [(2, b.block_tables.shape[1] * 16, 4)]  # >= 600 keys: 4 splits of >= 128
    check_attention(out, b, reference.paged_attention(*b.args()))
