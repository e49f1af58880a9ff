"""fp8 (e4m3) KV cache: the store and the paged attention of every backend against kernels/reference.py.

The reference defines the format: a key is stored as clamp(key / k_scale, +-448) rounded to e4m3
and read as e4m3 * k_scale (values alike with v_scale). Stores must match it byte for byte;
attention must match the reference on the same fp8 cache, and a float64 attention over the cache
dequantized in float32 (kernel_cases.naive_attention), within the query dtype's tolerance.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import kernels
from kernels import cpu_build, reference
from tests.kernels.kernel_cases import DEVICE, DTYPES, check_attention, make_batch

FP8 = getattr(torch, "float8_e4m3fn", None)
if FP8 is None:
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)

NAN_BYTE = 0x7F  # e4m3's NaN
# (k_scale, v_scale): vLLM's default without calibration, and scales that are not powers of two.
SCALES = [(1.0, 1.0), (0.37, 2.5)]
needs_cpu_kernels = pytest.mark.skipif(cpu_build.available() is not None, reason="the CPU kernels did not build")


def backends():
    """The backends to check on this machine: cpu where it runs, triton under the test's fixture."""
    names = ["torch", "triton"]
    return names + (["cpu"] if DEVICE == "cpu" else [])


def use_backend(name, request):
    if name == "triton":
        request.getfixturevalue("triton_ops")  # skips loudly where the kernels cannot run here
    if name == "cpu" and cpu_build.available() is not None:
        pytest.skip(f"CPU KERNELS NOT TESTED: they did not build ({cpu_build.available()})")


def poisoned_fp8_cache(backend, num_blocks, block_size, num_kv_heads, head_dim):
    """(k, v) in the backend's layout, every byte e4m3 NaN: a slot a store misses stays NaN."""
    caches = kernels.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, FP8, DEVICE, backend=backend)
    for c in caches:
        c.view(torch.uint8).fill_(NAN_BYTE)
    return caches


# ---- the format itself --------------------------------------------------------------------------


def test_quantize_saturates_instead_of_making_nan():
    x = torch.tensor([1000.0, -1000.0, 448.0, 460.0, -449.0, 3.0e38, float("inf")])
    q = reference.quantize_kv(x, FP8, 1.0)
    assert q.float().tolist() == [448.0, -448.0, 448.0, 448.0, -448.0, 448.0, 448.0]
    # The scale divides first: 100 / 0.1 = 1000 saturates too, and reads back as 448 * 0.1.
    assert reference.dequantize_kv(reference.quantize_kv(torch.tensor([100.0]), FP8, 0.1), torch.float32,
                                   0.1).item() == pytest.approx(44.8)
    assert bool(reference.quantize_kv(torch.tensor([float("nan")]), FP8, 1.0).float().isnan().all())


@pytest.mark.parametrize("scale", [1.0, 0.37, 0.01])
def test_round_trip_error_is_half_an_e4m3_step(scale):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 4 * scale
    back = reference.dequantize_kv(reference.quantize_kv(x, FP8, scale), torch.float32, scale)
    # e4m3 keeps 3 mantissa bits: a normal value is off by at most 2^-4 of itself; below 2^-6
    # (subnormal) the grid is 2^-9, so the error is at most 2^-10, in units of the scale.
    bound = torch.maximum(x.abs() * 2**-4, torch.full_like(x, 2**-10 * scale)) * (1 + 1e-6)
    assert bool(((back - x).abs() <= bound).all())
    assert reference.dequantize_kv(reference.quantize_kv(x, FP8, scale), torch.bfloat16, scale).dtype == torch.bfloat16


@pytest.mark.parametrize("head_major", [True, False])
def test_reference_write_kv_stores_the_quantized_bytes(head_major):
    gen = torch.Generator().manual_seed(1)
    nb, bs, h, d = 4, 8, 3, 24
    if head_major:  # the torch backend's layout
        k, v = (reference.allocate_kv_cache(nb, bs, h, d, FP8, "cpu") for _ in range(2))
    else:
        k, v = torch.zeros(nb, bs, h, d, dtype=FP8), torch.zeros(nb, bs, h, d, dtype=FP8)
    key, value = torch.randn(9, h, d, generator=gen) * 3, torch.randn(9, h, d, generator=gen)
    slots = torch.randperm(nb * bs, generator=gen)[:9]
    slots[4] = -1
    reference.write_kv(key, value, k, v, slots, 0.5, 0.25)
    real = slots >= 0
    for cache, new, scale in ((k, key, 0.5), (v, value, 0.25)):
        stored = cache.reshape(-1, h, d)[slots[real]].view(torch.uint8)
        assert torch.equal(stored, reference.quantize_kv(new[real], FP8, scale).view(torch.uint8))


# ---- the KV store: byte-exact against the reference ----------------------------------------------


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(1, 16, 16), (3, 80, 32), (2, 24, 8)])
@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_reference_bytes(request, backend, num_kv_heads, head_dim, block_size, k_scale, v_scale,
                                          dtype):
    use_backend(backend, request)
    num_blocks, num_tokens = 5, 19
    gen = torch.Generator().manual_seed(head_dim + block_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[3, 11, 18]] = -1  # padding tokens, the last one included
    # Keys as a strided slice of a fused projection; some far out of e4m3's range (saturate), some
    # in its subnormal range.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen)
    qkv[0, 0, :4] = torch.tensor([1e4, -1e4, 1e-3, -3e-3])
    qkv = qkv.to(dtype=dtype, device=DEVICE)
    key, value = qkv[:, :num_kv_heads], qkv[:, num_kv_heads:2 * num_kv_heads]
    slot_mapping = slots.to(DEVICE)

    k, v = poisoned_fp8_cache(backend, num_blocks, block_size, num_kv_heads, head_dim)
    kernels.write_kv(key, value, k, v, slot_mapping, backend=backend, k_scale=k_scale, v_scale=v_scale)
    k_ref, v_ref = poisoned_fp8_cache("torch", num_blocks, block_size, num_kv_heads, head_dim)
    reference.write_kv(key, value, k_ref, v_ref, slot_mapping, k_scale, v_scale)
    assert torch.equal(k.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v.view(torch.uint8), v_ref.view(torch.uint8))
    assert not k.float().isnan().flatten(0, 1)[slot_mapping[slot_mapping >= 0]].any(), "saturation made a NaN"
    assert int((k.view(torch.uint8) == NAN_BYTE).sum()) == (num_blocks * block_size - 16) * num_kv_heads * head_dim


@pytest.mark.parametrize("backend", backends())
def test_copy_blocks_moves_fp8_blocks(request, backend):
    use_backend(backend, request)
    k, v = poisoned_fp8_cache(backend, 5, 16, 2, 32)
    gen = torch.Generator().manual_seed(3)
    for c in (k, v):
        c.copy_(torch.randn(c.shape, generator=gen).to(device=DEVICE, dtype=FP8))
    k_before, v_before = k.clone(), v.clone()
    src, dst = torch.tensor([4, 1], device=DEVICE), torch.tensor([0, 3], device=DEVICE)
    kernels.copy_blocks(k, v, src, dst, backend=backend)
    for s, d in ((4, 0), (1, 3), (1, 1), (2, 2), (4, 4)):
        assert torch.equal(k[d].view(torch.uint8), k_before[s].view(torch.uint8))
        assert torch.equal(v[d].view(torch.uint8), v_before[s].view(torch.uint8))


# ---- paged attention over an fp8 cache --------------------------------------------------------------


def fp8_batch(q_lens, seq_lens, k_scale, v_scale, backend, **kw):
    """make_batch's batch with its caches quantized (NaN stays NaN outside every sequence) and laid
    out for `backend`; and the same batch over the cache dequantized in float32, for the float64
    definition."""
    b = make_batch(q_lens, seq_lens, **kw)
    k8 = reference.quantize_kv(b.k_cache, FP8, k_scale)  # unit normal values: about 5 / scale at most
    v8 = reference.quantize_kv(b.v_cache, FP8, v_scale)
    dequantized = dataclasses.replace(b, k_cache=reference.dequantize_kv(k8, torch.float32, k_scale),
                                      v_cache=reference.dequantize_kv(v8, torch.float32, v_scale))
    k, v = kernels.allocate_kv_cache(*k8.shape, FP8, DEVICE, backend=backend)
    k.copy_(k8)
    v.copy_(v8)
    return dataclasses.replace(b, k_cache=k, v_cache=v), dequantized


def check_fp8_attention(backend, b, dequantized, k_scale, v_scale):
    want = reference.paged_attention(*b.args(), k_scale=k_scale, v_scale=v_scale)
    if backend == "triton":  # it leaves rows past the last sequence alone: poison them to see that
        from kernels import triton_ops

        out = torch.full_like(b.query, float("nan"))
        triton_ops.paged_attention(*b.args(), out=out, k_scale=k_scale, v_scale=v_scale)
    else:
        out = kernels.paged_attention(*b.args(), backend=backend, k_scale=k_scale, v_scale=v_scale)
        if backend == "cpu":  # padding rows past the last sequence come back zeroed (cpu_ops.paged_attention)
            assert bool((out[b.num_tokens:] == 0).all())
        out[b.num_tokens:] = float("nan")  # check_attention wants them untouched (NaN)
    check_attention(out, dequantized, want)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("k_scale,v_scale", SCALES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch(request, backend, k_scale, v_scale, dtype):
    use_backend(backend, request)
    # Decodes among prefill chunks: one after a cached prefix ending mid-block, one a whole prompt,
    # a strided query (a slice of the fused projection) and padding rows after the last sequence.
    b, dq = fp8_batch([1, 7, 1, 12], [40, 21 + 7, 1, 12], k_scale, v_scale, backend, num_kv_heads=2, group=2,
                      head_dim=32, dtype=dtype, strided_query=True, pad_rows=2, seed=5)
    check_fp8_attention(backend, b, dq, k_scale, v_scale)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("head_dim,group,block_size", [(80, 3, 16), (24, 5, 8), (64, 1, 32)])
def test_odd_shapes(request, backend, head_dim, group, block_size):
    use_backend(backend, request)
    # A head_dim that is not a power of two nor whole vectors, GQA groups of 3 and 5 (register
    # passes of up to 4 heads on cpu), blocks of 8 and 32 keys.
    b, dq = fp8_batch([1, 5, 1], [33, 19, 9], 0.37, 2.5, backend, num_kv_heads=2, group=group, head_dim=head_dim,
                      block_size=block_size, dtype=torch.float32, seed=head_dim)
    check_fp8_attention(backend, b, dq, 0.37, 2.5)


@pytest.mark.parametrize("backend", backends())
def test_every_e4m3_value_reads_exactly(request, backend):
    # One cached key: the output is its value row times v_scale, exactly. The row holds every e4m3
    # bit pattern but NaN's (subnormals, zeros of both signs, +-448), 254 of them: whole vectors and
    # a partial one in the kernels' conversions.
    use_backend(backend, request)
    patterns = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    k, v = kernels.allocate_kv_cache(2, 8, 1, patterns.numel(), FP8, DEVICE, backend=backend)
    k.view(torch.uint8).fill_(0x38)  # 1.0
    v.view(torch.uint8).copy_(patterns.to(DEVICE).expand(v.shape))
    query = torch.ones(1, 1, patterns.numel(), device=DEVICE)
    tables, qsl, lens = (torch.tensor(x, device=DEVICE) for x in ([[1]], [0, 1], [1]))
    out = kernels.paged_attention(query, k, v, tables, qsl, lens, 0.1, backend=backend, v_scale=0.75)
    want = reference.dequantize_kv(patterns.view(FP8), torch.float32, 0.75)
    assert torch.equal(out[0, 0].cpu(), want)


@pytest.mark.skipif(DEVICE != "cpu", reason="the cpu backend")
@needs_cpu_kernels
def test_cpu_long_contexts():
    # Many blocks per sequence (the C++ loop prefetches blocks ahead) under a 16-bit model. float16:
    # over 700 keys the bfloat16 reference itself drifts past bfloat16's tolerance.
    b, dq = fp8_batch([1, 1, 64], [700, 333, 64 + 250], 0.5, 1.0, "cpu", dtype=torch.float16, seed=9)
    check_fp8_attention("cpu", b, dq, 0.5, 1.0)
    # A lone row on one KV head: its context split into chunks, merged with v_scale applied once.
    b, dq = fp8_batch([1], [700], 0.5, 2.0, "cpu", num_kv_heads=1, dtype=torch.float32, seed=10)
    check_fp8_attention("cpu", b, dq, 0.5, 2.0)


# ---- the engine on the triton backend (interpreted on CPU: a few tokens) ------------------------------


@pytest.mark.device_auto  # the Triton kernels compiled on CUDA where there is a GPU, interpreted here
@pytest.mark.slow  # ~8 s under the interpreter
def test_engine_fp8_on_triton_matches_torch(triton_ops, tmp_path):
    from engine import LLM, SamplingParams
    from tests.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny", num_attention_heads=4, num_key_value_heads=2)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 21)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = {}
    for backend in ("triton", "torch"):
        llm = LLM(path, attention_backend=backend, dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=16,
                  max_num_batched_tokens=16, max_model_len=128)  # float32: "auto" is bfloat16 on CUDA
        assert llm.engine.runner.kv_dtype == FP8
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # Both store the same bytes (write_kv is byte-exact) and read them through float math that
    # differs only in summation order, so a float32 model picks the same tokens.
    assert outs["triton"] == outs["torch"]
