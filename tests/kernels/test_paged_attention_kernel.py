"""Triton paged attention against kernels/reference.py and a float64 naive attention.

Each case fixes the launch (tile shape, split count) so every code path runs on small shapes; the
output is NaN-poisoned before the run so a row the kernel forgets to write fails the check.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels import reference
from kernels.triton_heuristics import TileConfig, next_power_of_2, tile_config
from tests.kernels.kernel_cases import DEVICE, DTYPES, check_attention, make_batch

# "decode" and "prefill" are the tiles the heuristics pick; "narrow" has 16-key steps so that short
# contexts cross many tile and split boundaries cheaply under the interpreter.
TILES = ("decode", "prefill", "narrow")


def tile(kind: str, group: int, head_dim: int):
    if kind == "narrow":
        return TileConfig(max(16, next_power_of_2(group)), 16, 4, 1)
    num_tokens = 1 if kind == "decode" else 1000
    return tile_config(num_tokens, 1, group, next_power_of_2(head_dim))


def run(triton_ops, b, kind: str = "decode", num_splits: int | None = 1) -> None:
    group = b.query.shape[1] // b.k_cache.shape[2]
    out = torch.full_like(b.query, float("nan"))
    got = triton_ops.paged_attention(*b.args(), out=out, num_splits=num_splits,
                                     config=tile(kind, group, b.query.shape[2]))
    assert got is out
    check_attention(out, b, reference.paged_attention(*b.args()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", TILES)
def test_single_token(triton_ops, dtype, kind):
    run(triton_ops, make_batch([1], [1], dtype=dtype), kind)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_chunk_after_prefix_ending_mid_block(triton_ops, block_size, dtype):
    # Cached prefixes of 21 and 45 keys end inside a block; the new chunks cross block boundaries.
    b = make_batch([7, 30], [21 + 7, 45 + 30], block_size=block_size, dtype=dtype)
    for kind in TILES:
        run(triton_ops, b, kind)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gqa_ratios_and_block_sizes(triton_ops, group, block_size):
    b = make_batch([1, 9, 1], [33, 40, 70], group=group, block_size=block_size, dtype=torch.float16,
                   seed=group * block_size)
    run(triton_ops, b, "decode")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_dims(triton_ops, head_dim, dtype):
    # 80 and 96 are padded to 128 lanes with masks; 256 takes the smaller prefill tile.
    b = make_batch([1, 12], [50, 12], num_kv_heads=1, group=2, head_dim=head_dim, dtype=dtype, seed=head_dim)
    run(triton_ops, b, "prefill")


def test_prefixes_at_tile_boundaries(triton_ops):
    # The first query sits just before, on and just after a 64- and a 16-key boundary: the last
    # tile that may skip the causal mask ends exactly there.
    b = make_batch([3, 3, 3, 1, 1, 1], [62 + 3, 63 + 3, 64 + 3, 63, 64, 65], group=2, seed=7)
    for kind in TILES:
        run(triton_ops, b, kind)


# Under the interpreter (CPU) each split count runs in one dtype, each dtype once: the product is
# for the GPU, where it costs nothing.
# 8 splits (~10 s there) runs in the slow lane only.
SPLIT_CASES = [(n, d) for n in (2, 4, 8) for d in DTYPES] if DEVICE == "cuda" else list(zip((2, 4, 8), DTYPES))
SPLIT_CASES = [pytest.param(n, d, marks=pytest.mark.slow) if n == 8 and DEVICE == "cpu" else (n, d)
               for n, d in SPLIT_CASES]


@pytest.mark.parametrize("num_splits, dtype", SPLIT_CASES)
def test_split_kv(triton_ops, num_splits, dtype):
    # Long decodes, a short decode whose later splits are empty, a chunk after a prefix and a whole
    # prompt whose early rows see nothing in the later splits: the reduce must weigh those to zero.
    # Narrow tiles put split boundaries inside these short contexts (the mixed-batch test and the
    # random batches split with the real tiles).
    b = make_batch([1, 1, 1, 20, 40], [150, 200, 5, 90, 40], group=4, dtype=dtype, seed=num_splits)
    run(triton_ops, b, "narrow", num_splits=num_splits)


@pytest.mark.slow  # ~20 s under the interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_of_prefill_chunks_and_decodes(triton_ops, dtype):
    # int64 metadata, a query that is a strided view of a fused qkv tensor, and padding rows past
    # the last sequence (as a CUDA-graph batch has) that no kernel may write. Every tile with and
    # without splits; under the interpreter one dtype takes them all, the others one tile each.
    b = make_batch([1, 17, 1, 40, 1], [90, 17, 5, 63, 129], group=8, num_kv_heads=1, dtype=dtype,
                   index_dtype=torch.int64, pad_rows=3, strided_query=True)
    i = DTYPES.index(dtype)
    for kind in TILES if DEVICE == "cuda" or i == 0 else TILES[i:i + 1]:
        for num_splits in (1, 4):
            run(triton_ops, b, kind, num_splits)


@pytest.mark.parametrize("query_dtype,cache_dtype", [(torch.float32, torch.float16), (torch.float16, torch.float32)])
def test_cache_dtype_differs_from_query_dtype(triton_ops, query_dtype, cache_dtype):
    # kv_cache_dtype may differ from the model's dtype: attention runs in the query's dtype.
    b = make_batch([1, 6], [40, 30], dtype=cache_dtype)
    b.query = b.query.to(query_dtype)
    run(triton_ops, b, "decode", num_splits=2)


def test_sequence_with_no_new_queries(triton_ops):
    run(triton_ops, make_batch([0, 3, 0], [10, 3, 4]), "decode")


def test_public_entry_point_chooses_launch_itself(triton_ops):
    b = make_batch([1, 1, 24], [300, 40, 60], group=4, dtype=torch.float16)
    for backend in ("torch", "triton"):
        check_attention(kernels.paged_attention(*b.args(), backend=backend), b, reference.paged_attention(*b.args()))


@st.composite
def batches(draw):
    seqs = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["decode", "chunk", "prompt"]))
        q_len = 1 if kind == "decode" else draw(st.integers(2, 40))
        prefix = 0 if kind == "prompt" else draw(st.integers(0 if kind == "chunk" else 1, 160))
        seqs.append((q_len, prefix + q_len))
    return dict(
        q_lens=[q for q, _ in seqs], seq_lens=[s for _, s in seqs],
        num_kv_heads=draw(st.integers(1, 2)), group=draw(st.integers(1, 8)),
        head_dim=draw(st.sampled_from([64, 80, 96, 128, 256])),
        block_size=draw(st.sampled_from([8, 16, 32, 64, 128])),  # every size EngineConfig allows
        dtype=draw(st.sampled_from(DTYPES)), index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        seed=draw(st.integers(0, 2**16)))


@pytest.mark.slow  # ~25 s under the interpreter; the cases above cover each path in the fast lane
@settings(max_examples=12 if DEVICE == "cpu" else 100, deadline=None, derandomize=True)
@given(case=batches(), kind=st.sampled_from(TILES), num_splits=st.sampled_from([None, 1, 2, 4, 8]))
def test_random_batches(triton_ops, case, kind, num_splits):
    run(triton_ops, make_batch(**case), kind, num_splits)
