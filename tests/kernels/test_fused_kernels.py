"""Triton fused elementwise kernels (kernels/triton_fused.py) against kernels/reference.py and float64.

The kernels round where the reference rounds. Rotary and the residual add are elementwise, so
under the interpreter (numpy float32, no fma) they match the reference bit for bit, and the KV
store byte for byte; the norm's sum of squares and SiLU's exp differ from torch's in float32 ulps,
so they match within one rounding of the dtype. Compiled for a GPU a multiply-add may be
contracted: there rotary too matches within a rounding. Odd sizes (not powers of two, smaller
than a warp, several tiles) and strided inputs run in every dtype.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference
from tests.kernels.kernel_cases import DEVICE, DTYPES

# Against float64: a few roundings of the dtype (outputs are O(1): normed rows, rotated normals).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
# Against the reference where not exact: one rounding of the dtype (a few ulps in float32).
ONE_ROUNDING = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}
EXACT = DEVICE == "cpu"  # the interpreter: see the module docstring
FP8 = getattr(torch, "float8_e4m3fn", None)


def randn(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def assert_matches(got, want, dtype, exact=EXACT):
    assert got.dtype == want.dtype and got.shape == want.shape
    if exact:
        assert torch.equal(got, want), f"max difference {(got.double() - want.double()).abs().max().item()}"
    else:
        atol, rtol = ONE_ROUNDING[dtype]
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


# ---- residual add + RMSNorm -----------------------------------------------------------------------


def rms_norm_f64(x, weight, eps):
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [16, 100, 576, 1000, 2048])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(triton_ops, dtype, hidden, with_residual):
    # Rows of a wider tensor (strided), scaled up so the sum of squares is far from 1.
    x = randn(7, hidden + 24, dtype=dtype, seed=hidden, scale=3.0)[:, :hidden]
    residual = randn(7, hidden, dtype=dtype, seed=hidden + 1) if with_residual else None
    weight = randn(hidden, dtype=dtype, seed=hidden + 2)
    x_before = x.clone()
    got = triton_ops.rms_norm(x, weight, 1e-6, residual)
    want = reference.rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(x, x_before), "the input must not change"
    if with_residual:
        (got, got_residual), (want, want_residual) = got, want
        assert torch.equal(got_residual, want_residual)  # one add in the dtype: exact everywhere
        summed = want_residual
    else:
        summed = x
    assert_matches(got, want, dtype, exact=False)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), rms_norm_f64(summed, weight, 1e-6), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_on_head_strided_rows(triton_ops, dtype):
    # Qwen3's q norm: [tokens, heads, head_dim], a view into the fused qkv projection.
    qkv = randn(5, 4 + 2 * 2, 64, dtype=dtype, seed=3)
    q = qkv[:, :4]
    weight = randn(64, dtype=dtype, seed=4)
    got = triton_ops.rms_norm(q, weight, 1e-6)
    assert got.shape == q.shape and got.is_contiguous()
    assert_matches(got, reference.rms_norm(q, weight, 1e-6), dtype, exact=False)


def test_rms_norm_no_rows(triton_ops):
    x = torch.empty(0, 64, device=DEVICE)
    y, s = triton_ops.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6, torch.empty(0, 64, device=DEVICE))
    assert y.shape == s.shape == (0, 64)


# ---- rotary + KV store -------------------------------------------------------------------------------


def poisoned(shape, dtype):
    if dtype == FP8:
        cache = torch.empty(shape, dtype=torch.uint8, device=DEVICE).fill_(0x7F)  # e4m3 NaN
        return cache.view(FP8)
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def rope(num_tokens, half, dtype, seed):
    # As RotaryEmbedding gives them: float32 tables, gathered by position, cast to the model's dtype.
    pos = torch.randint(0, 4096, (num_tokens,), generator=torch.Generator().manual_seed(seed)).double()
    freqs = pos[:, None] / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half))
    cos, sin = (f.float().unsqueeze(1).to(dtype=dtype, device=DEVICE) for f in (freqs.cos(), freqs.sin()))
    return cos, sin


def same_cache(got, want):
    if got.dtype == FP8:
        return torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    return torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())


# (query heads, kv heads, head_dim): GQA, MHA, MQA; head dims of 80 and 24 pad their halves.
HEADS = [(4, 2, 64), (3, 3, 80), (5, 1, 24), (8, 2, 128), (2, 1, 256)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
def test_rotary_write_kv(triton_ops, dtype, num_heads, num_kv_heads, head_dim):
    check_rotary_write_kv(triton_ops, dtype, dtype, num_heads, num_kv_heads, head_dim)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float16),
                                               (torch.float16, torch.bfloat16)])
def test_rotary_write_kv_to_a_cache_of_another_dtype(triton_ops, dtype, cache_dtype):
    check_rotary_write_kv(triton_ops, dtype, cache_dtype, 4, 2, 64)  # kv_cache_dtype differs from the model's


def check_rotary_write_kv(triton_ops, dtype, cache_dtype, num_heads, num_kv_heads, head_dim):
    num_tokens, block_size, num_blocks = 9, 16, 3
    # q | k | v of a fused projection, as the attention layer hands them over.
    qkv = randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, seed=head_dim)
    qk, value = qkv[:, :num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
    cos, sin = rope(num_tokens, head_dim // 2, dtype, seed=head_dim)
    gen = torch.Generator().manual_seed(num_heads)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[1, 8]] = -1  # padding tokens, the last one included: rotated, never stored
    slot_mapping = slots.to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    want_qk = reference.apply_rotary(qk.clone(), cos, sin)
    k_want, v_want = poisoned(shape, cache_dtype), poisoned(shape, cache_dtype)
    reference.write_kv(want_qk[:, num_heads:], value, k_want, v_want, slot_mapping)
    value_before = value.clone()

    k_cache, v_cache = poisoned(shape, cache_dtype), poisoned(shape, cache_dtype)
    got = triton_ops.rotary_write_kv(qk, value, cos, sin, k_cache, v_cache, slot_mapping)
    assert got.data_ptr() == qkv.data_ptr(), "qk is rotated in place"
    assert_matches(got, want_qk, dtype)
    assert torch.equal(value, value_before)
    if EXACT:
        assert same_cache(k_cache, k_want) and same_cache(v_cache, v_want)
    # Whatever the rounding of the rotation, the cache holds the keys the queries were rotated with.
    real = slot_mapping >= 0
    written = slot_mapping[real]
    assert torch.equal(k_cache.flatten(0, 1)[written], got[real, num_heads:].to(cache_dtype))
    assert torch.equal(v_cache.flatten(0, 1)[written], value[real].to(cache_dtype))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert k_cache.flatten(0, 1)[untouched].isnan().all() and v_cache.flatten(0, 1)[untouched].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_against_float64(triton_ops, dtype):
    qk = randn(6, 6, 96, dtype=dtype, seed=11)
    cos, sin = rope(6, 48, dtype, seed=11)
    a, b = qk.double().chunk(2, dim=-1)
    c, s = cos.double(), sin.double()
    want = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    got = triton_ops.apply_rotary(qk, cos, sin)
    assert got.data_ptr() == qk.data_ptr()
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want, atol=atol, rtol=rtol)


@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 2.5)])
def test_rotary_write_kv_fp8_cache(triton_ops, dtype, k_scale, v_scale):
    num_tokens, shape = 7, (2, 8, 2, 80)
    qkv = randn(num_tokens, 4 + 2 * 2, 80, dtype=dtype, seed=5, scale=40.0)  # some saturate at 448
    qk, value = qkv[:, :6], qkv[:, 6:]
    cos, sin = rope(num_tokens, 40, dtype, seed=5)
    slot_mapping = torch.tensor([3, 9, -1, 0, 15, 4, 12], device=DEVICE)
    want_qk = reference.apply_rotary(qk.clone(), cos, sin)
    k_want, v_want = poisoned(shape, FP8), poisoned(shape, FP8)
    reference.write_kv(want_qk[:, 4:], value, k_want, v_want, slot_mapping, k_scale, v_scale)
    x1, x2 = qk.double().abs().chunk(2, dim=-1)  # before the kernel rotates qk in place
    c, s = cos.double().abs(), sin.double().abs()
    size = torch.cat((x1 * c + x2 * s, x2 * c + x1 * s), dim=-1)  # each half's own products
    k_cache, v_cache = poisoned(shape, FP8), poisoned(shape, FP8)
    kernels.rotary_write_kv(qk, value, cos, sin, k_cache, v_cache, slot_mapping, backend="triton",
                            k_scale=k_scale, v_scale=v_scale)
    if EXACT:
        assert same_cache(k_cache, k_want) and same_cache(v_cache, v_want)
    # On a GPU a contracted multiply-add may move a 16-bit rotated key by an ulp of the products
    # (|x1 c| + |x2 s|, up to ~100 here: bfloat16's ulp there is 0.5), and the cancellation in
    # x1 c - x2 s can leave that many e4m3 steps wide. So: the rotation within two units of
    # roundoff of the products' size, and the cache exactly the reference's quantization of the
    # keys this very kernel rotated the queries with.
    ratio = (qk.double() - want_qk.double()).abs() / (2 * torch.finfo(dtype).eps * size)
    worst = ratio.argmax().item()
    assert ratio.max() <= 1, (f"rotation off by {ratio.max().item():.3g}x two roundoffs at flat index {worst}: "
                              f"{qk.flatten()[worst].item()} vs {want_qk.flatten()[worst].item()}")
    k_own, v_own = poisoned(shape, FP8), poisoned(shape, FP8)
    reference.write_kv(qk[:, 4:], value, k_own, v_own, slot_mapping, k_scale, v_scale)
    assert same_cache(k_cache, k_own) and same_cache(v_cache, v_own)


@pytest.mark.parametrize("backend", ["torch", "triton"] + (["cpu"] if DEVICE == "cpu" else []))
def test_every_backend_rotary_write_kv_is_rotary_then_write_kv(request, backend):
    if backend == "triton":
        request.getfixturevalue("triton_ops")  # skips loudly where the kernels cannot run here
    if backend == "cpu":
        from kernels import cpu_build

        if cpu_build.available() is not None:
            pytest.skip(f"CPU KERNELS NOT TESTED: they did not build ({cpu_build.available()})")
    qkv = randn(5, 4 + 2 * 2, 64, dtype=torch.float32, seed=9)
    cos, sin = rope(5, 32, torch.float32, seed=9)
    slots = torch.tensor([4, -1, 17, 0, 30], device=DEVICE)
    k_cache, v_cache = kernels.allocate_kv_cache(2, 16, 2, 64, torch.float32, DEVICE, backend=backend)
    want = reference.apply_rotary(qkv[:, :6].clone(), cos, sin)  # first: a backend may rotate in place
    got = kernels.rotary_write_kv(qkv[:, :6], qkv[:, 6:], cos, sin, k_cache, v_cache, slots, backend=backend)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    real = slots >= 0
    torch.testing.assert_close(k_cache.flatten(0, 1)[slots[real]], want[real, 4:], atol=1e-6, rtol=1e-6)
    assert torch.equal(v_cache.flatten(0, 1)[slots[real]], qkv[real, 6:])


# ---- SiLU and mul --------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # the interpreter's numpy
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1, 37, 1024, 1500])
def test_silu_and_mul(triton_ops, dtype, inter):
    # Rows of a wider tensor; large gates too (exp(-x) overflows to inf: silu must give -0, not NaN).
    x = randn(6, 2 * inter + 8, dtype=dtype, seed=inter, scale=4.0)[:, :2 * inter]
    x[0, :min(inter, 4)] = torch.tensor([-100.0, 100.0, -1e4, 0.0][:min(inter, 4)], dtype=dtype)
    got = triton_ops.silu_and_mul(x)
    want = reference.silu_and_mul(x)
    assert_matches(got, want, dtype, exact=False)
    gate, up = x.double().chunk(2, dim=-1)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), gate * torch.sigmoid(gate) * up, atol=atol, rtol=rtol)
    assert not got.isnan().any()


def test_silu_and_mul_no_rows(triton_ops):
    assert triton_ops.silu_and_mul(torch.empty(0, 64, device=DEVICE)).shape == (0, 32)


# ---- wiring ------------------------------------------------------------------------------------------


def test_triton_backend_uses_the_fused_kernels(triton_ops):
    backend = kernels.get_backend("triton")
    assert backend.rms_norm is triton_ops.rms_norm
    assert backend.apply_rotary is triton_ops.apply_rotary
    assert backend.rotary_write_kv is triton_ops.rotary_write_kv
    assert backend.silu_and_mul is triton_ops.silu_and_mul
