"""Sliding window, logit soft-capping and attention sinks in every paged-attention backend, each
checked against a float64 softmax written out here from the definitions (transformers' masking_utils
sliding_window_overlay: key > query - window; Gemma 2's cap * tanh(score / cap) on the scaled score;
gpt-oss's sink: one more logit per head in the softmax's denominator, with no value).

Batches come from kernel_cases.make_batch: cache slots outside every context are NaN, so a backend
that reads a key it should not fails; keys inside a context but outside the window are real
numbers, so a backend that forgets the window is off by their weight.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kernels
from kernels import cpu_build, reference
from kernels.triton_heuristics import TileConfig
from tests.kernels.kernel_cases import DEVICE, DTYPES, NAN, TOLERANCE, make_batch, naive_attention, to_cpu_layout

CPU_ERROR = cpu_build.available() if DEVICE == "cpu" else RuntimeError("the cpu backend runs on CPU tensors")

# Each feature alone and all three together; the sinks are drawn per test (one per query head).
FEATURES = {
    "window": dict(sliding_window=13),
    "soft_cap": dict(logits_soft_cap=0.7),
    "sinks": dict(sinks=True),
    "all": dict(sliding_window=13, logits_soft_cap=0.7, sinks=True),
}
# Decodes at short, odd and block-edge contexts, a prefill chunk after a cached prefix that ends
# mid-block, and a whole prompt: with block_size 16 and GQA 4 (2 KV heads).
Q_LENS, SEQ_LENS = [1, 7, 1, 1, 19], [37, 40, 16, 3, 19]


def with_sinks(b, features: dict) -> dict:
    """features with `sinks=True` replaced by one logit per query head (some above the scores, so a
    sink holds much of a row's weight and a backend that drops it is far off)."""
    if features.get("sinks") is True:
        gen = torch.Generator().manual_seed(1)
        features = dict(features, sinks=(torch.randn(b.query.shape[1], generator=gen) * 2).to(DEVICE))
    return features


def attend(backend: str, b, features: dict, triton_ops=None, **launch) -> torch.Tensor:
    if backend == "triton":
        out = torch.full_like(b.query, NAN)
        return triton_ops.paged_attention(*b.args(), out=out, **launch, **features)
    if backend == "cpu":
        b = to_cpu_layout(b)
    return kernels.paged_attention(*b.args(), backend=backend, **features)


def check(got: torch.Tensor, b, features: dict) -> None:
    atol, rtol = TOLERANCE[b.query.dtype]
    got = got[: b.num_tokens].cpu().double()
    assert not got.isnan().any(), "an output row was left unwritten or read a slot outside its context"
    torch.testing.assert_close(got, naive_attention(b, **features)[: b.num_tokens], atol=atol, rtol=rtol)


def backend_or_skip(backend: str, request):
    if backend == "cpu" and CPU_ERROR is not None:
        pytest.skip(f"CPU KERNELS NOT TESTED: {CPU_ERROR}")
    return request.getfixturevalue("triton_ops") if backend == "triton" else None


def test_the_oracle_sees_each_feature():
    # Each feature changes the float64 answer on this batch (so the checks below can fail), and a
    # window wider than every context changes nothing.
    b = make_batch(Q_LENS, SEQ_LENS, num_kv_heads=2, group=4, dtype=torch.float64)
    plain = naive_attention(b)
    for name, features in FEATURES.items():
        assert not torch.allclose(naive_attention(b, **with_sinks(b, features)), plain, atol=1e-3), name
    torch.testing.assert_close(naive_attention(b, sliding_window=1000), plain)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FEATURES)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_features_on_decodes_and_prefill_chunks(request, backend, name, dtype):
    backend_or_skip(backend, request)
    b = make_batch(Q_LENS, SEQ_LENS, num_kv_heads=2, group=4, dtype=dtype, seed=3)
    features = with_sinks(b, FEATURES[name])
    check(attend(backend, b, features), b, features)


# Windows of one key, under a block, one and two blocks exactly (16 / 32 keys at block_size 16), an
# odd one that ends mid-block, and one wider than every context.
WINDOWS = [1, 5, 16, 32, 21, 1000]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_window_sizes_against_block_edges(request, backend, window):
    backend_or_skip(backend, request)
    # Contexts that end on (32, 48) and just past (33, 17) a block edge; a chunk whose rows cross one.
    b = make_batch([1, 1, 1, 1, 9], [32, 33, 48, 17, 41], num_kv_heads=1, group=2, seed=window)
    features = dict(sliding_window=window, sinks=True)
    features = with_sinks(b, features)
    check(attend(backend, b, features), b, features)


@pytest.mark.parametrize("length", [300, 301])
def test_cpu_lone_long_row_splits_its_window_and_merges_the_sink(length):
    # One decode row on 2 KV heads is too few work items for the threads: the cpu kernel splits
    # the row's keys into chunks and merges them; the sink must join the merge once.
    if CPU_ERROR is not None:
        pytest.skip(f"CPU KERNELS NOT TESTED: {CPU_ERROR}")
    b = make_batch([1], [length], num_kv_heads=2, group=3, seed=length)
    for features in (dict(sliding_window=200, sinks=True, logits_soft_cap=2.0), dict(sinks=True)):
        features = with_sinks(b, features)
        check(attend("cpu", b, features), b, features)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_window_skips_blocks_it_cannot_see(request, backend):
    # Blocks wholly before every row's window are neither read nor checked (a window layer may
    # release them): poisoned with NaN and named by a table entry outside the cache, the answer is
    # still the window's. Blocks of 8 keys under Triton's 16-key tiles: a tile starts before the
    # window's first block, so the kernel must mask those keys' loads, not only their scores.
    triton_ops = backend_or_skip(backend, request)
    block_size, window, q_lens = 8, 20, [1, 4]
    b = make_batch(q_lens, [70, 64], num_kv_heads=1, group=2, block_size=block_size, seed=5)
    if backend == "cpu":
        b = to_cpu_layout(b)
    features = dict(sliding_window=window)
    want = naive_attention(b, **features)
    for i, (q_len, seq_len) in enumerate(zip(q_lens, b.seq_lens.tolist())):
        first_seen = (seq_len - q_len - window + 1) // block_size  # the first row's oldest visible key's block
        for j in range(first_seen):
            b.k_cache[b.block_tables[i, j]] = NAN
            b.v_cache[b.block_tables[i, j]] = NAN
        b.block_tables[i, :first_seen] = 10_000
    if backend == "triton":
        got = triton_ops.paged_attention(*b.args(), out=torch.full_like(b.query, NAN), config=NARROW, num_splits=2,
                                         **features)
    else:
        got = kernels.paged_attention(*b.args(), backend="cpu", **features)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


def test_cpu_rejects_a_window_of_zero():
    if CPU_ERROR is not None:
        pytest.skip(f"CPU KERNELS NOT TESTED: {CPU_ERROR}")
    b = to_cpu_layout(make_batch([1], [20]))
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        kernels.paged_attention(*b.args(), backend="cpu", sliding_window=0)


# Under the interpreter the Triton kernel runs each feature set once, in one dtype each, on narrow
# 16-key tiles (many tile and window edges on short contexts); splits exercise the reduce's sink.
NARROW = TileConfig(16, 16, 4, 1)
TRITON_CASES = [("window", torch.float32, 1), ("soft_cap", torch.float16, 1), ("sinks", torch.bfloat16, 1),
                ("all", torch.float32, 1), ("all", torch.float16, 4), ("sinks", torch.float32, 2)]


@pytest.mark.parametrize("name, dtype, num_splits", TRITON_CASES)
def test_triton_features(triton_ops, name, dtype, num_splits):
    b = make_batch(Q_LENS, SEQ_LENS, num_kv_heads=2, group=4, dtype=dtype, seed=3)
    features = with_sinks(b, FEATURES[name])
    check(attend("triton", b, features, triton_ops, config=NARROW, num_splits=num_splits), b, features)


@pytest.mark.parametrize("window", WINDOWS)
def test_triton_window_sizes_against_block_edges(triton_ops, window):
    b = make_batch([1, 1, 1, 1, 9], [32, 33, 48, 17, 41], num_kv_heads=1, group=2, seed=window)
    features = with_sinks(b, dict(sliding_window=window, sinks=True))
    check(attend("triton", b, features, triton_ops, config=NARROW, num_splits=1), b, features)


def test_triton_windowed_split_long_decode(triton_ops):
    # A long decode with a window that starts mid-block: the splits cover only the window's tiles.
    b = make_batch([1, 1], [200, 90], num_kv_heads=1, group=2, seed=11)
    features = with_sinks(b, dict(sliding_window=45, logits_soft_cap=1.5, sinks=True))
    check(attend("triton", b, features, triton_ops, config=NARROW, num_splits=4), b, features)


def test_dispatch_without_features_is_unchanged():
    # The defaults are the features off: the same answer as the reference called without them.
    b = make_batch(Q_LENS, SEQ_LENS, num_kv_heads=2, group=4, seed=2)
    torch.testing.assert_close(kernels.paged_attention(*b.args(), backend="torch", sliding_window=None,
                                                       logits_soft_cap=None, sinks=None),
                               reference.paged_attention(*b.args()), atol=0, rtol=0)


def test_triton_through_the_dispatch_with_its_own_launch(triton_ops):
    # kernels.paged_attention(backend="triton") passes the features on; the heuristics pick the tile.
    b = make_batch([1, 12], [70, 30], num_kv_heads=1, group=4, dtype=torch.float16, seed=4)
    features = with_sinks(b, FEATURES["all"])
    check(kernels.paged_attention(*b.args(), backend="triton", **features), b, features)


FP8 = getattr(torch, "float8_e4m3fn", None)


@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_fp8_cache_caps_the_true_score(request, backend):
    # An fp8 cache folds k_scale into the score: the cap must apply to the score it makes
    # (score * k_scale), not to the e4m3 dot product, and v_scale still multiplies the output.
    triton_ops = backend_or_skip(backend, request)
    k_scale, v_scale = 0.37, 2.5
    b = make_batch([1, 6], [41, 6 + 20], num_kv_heads=2, group=2, seed=8)
    k8, v8 = (reference.quantize_kv(c, FP8, s) for c, s in ((b.k_cache, k_scale), (b.v_cache, v_scale)))
    exact = dataclasses.replace(b, k_cache=reference.dequantize_kv(k8, torch.float32, k_scale),
                                v_cache=reference.dequantize_kv(v8, torch.float32, v_scale))
    if backend == "triton":  # its caches are plain contiguous tensors
        k, v = k8.clone(), v8.clone()
    else:
        k, v = kernels.allocate_kv_cache(*k8.shape, FP8, DEVICE, backend=backend)
        k.copy_(k8)
        v.copy_(v8)
    b = dataclasses.replace(b, k_cache=k, v_cache=v)
    features = with_sinks(b, FEATURES["all"])
    if backend == "triton":
        got = triton_ops.paged_attention(*b.args(), out=torch.full_like(b.query, NAN), config=NARROW, num_splits=1,
                                         k_scale=k_scale, v_scale=v_scale, **features)
    else:
        got = kernels.paged_attention(*b.args(), backend=backend, k_scale=k_scale, v_scale=v_scale, **features)
    check(got, exact, features)
