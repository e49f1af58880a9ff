"""The start-up warm-up (triton_ops.warmup) covers every launch a step can make.

On CPU: the (tile, split count) pairs it compiles contain every choice launch_plan makes for
random batches on GPUs of several sizes, and it runs under the interpreter. That a new batch shape
picks no new binary after it (do_not_specialize) is checked without a GPU by
test_kernels_compile_for_gpu.py; on a GPU the test at the end counts Triton's own caches.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.kernels.kernel_cases import DEVICE

# (heads, kv heads, head dim, block size, max_model_len): Llama-3.2-1B, Qwen3-0.6B, an MHA model
# with head dim 256 and long context, MQA.
MODELS = [(32, 8, 64, 16, 8192), (16, 8, 128, 16, 40960), (8, 8, 256, 32, 131072), (8, 1, 80, 16, 4096)]


@pytest.mark.parametrize("num_sms", [1, 16, 108, 132, 170])
@pytest.mark.parametrize("model", MODELS)
def test_attention_variants_cover_every_launch_plan(triton_ops, monkeypatch, model, num_sms):
    num_heads, num_kv_heads, head_dim, block_size, max_model_len = model
    variants = set(triton_ops.attention_variants(num_heads, num_kv_heads, head_dim, block_size, max_model_len,
                                                 num_sms))
    monkeypatch.setattr(triton_ops, "_num_sms", lambda device: num_sms)
    k_cache = torch.empty(1, block_size, num_kv_heads, head_dim)
    rng = random.Random(num_sms * num_heads)
    max_blocks = -(-max_model_len // block_size)
    chosen = set()
    for _ in range(300):
        num_seqs = rng.choice([1, 1, 2, 3, 8, 64, 256])
        num_tokens = num_seqs * rng.choice([1, 1, 2, 8, 64, 512])
        width = rng.choice([1, 2, 16, max_blocks // 8, max_blocks // 2, max_blocks])
        query = torch.empty(num_tokens, num_heads, head_dim)
        plan = triton_ops.launch_plan(query, k_cache, torch.empty(num_seqs, max(width, 1)), num_seqs)
        assert plan in variants, f"{num_seqs} seqs, {num_tokens} tokens, {width} blocks wide: {plan}"
        chosen.add(plan)
    splits = {s for _, s in variants}
    assert splits == {1 << i for i in range(len(splits))}, "split counts are the powers of two up to the most"
    if num_sms >= 108 and max_model_len >= 4096:
        assert max(splits) > 1 and any(s > 1 for _, s in chosen), "a big GPU splits long contexts"


@pytest.mark.parametrize("dtype,kv_cache_dtype,qk_norm", [(torch.float32, None, False), (torch.bfloat16, None, True),
                                                           (torch.float16, "fp8", False)])
def test_warmup_runs(triton_ops, dtype, kv_cache_dtype, qk_norm):
    if kv_cache_dtype == "fp8":
        kv_cache_dtype = getattr(torch, "float8_e4m3fn", None)
        if kv_cache_dtype is None:
            pytest.skip("this torch has no float8_e4m3fn")
    launches = triton_ops.warmup(num_heads=4, num_kv_heads=2, head_dim=32, block_size=16, max_model_len=256,
                                 dtype=dtype, device=DEVICE, kv_cache_dtype=kv_cache_dtype, hidden_size=48,
                                 intermediate_sizes=(40, 96), qk_norm=qk_norm)
    variants = triton_ops.attention_variants(4, 2, 32, 16, 256, triton_ops._num_sms(torch.device(DEVICE)))
    attention = sum(1 if s == 1 else 2 for _, s in variants)
    assert launches == (2 if qk_norm else 0) + 1 + attention + 2 + 2


@pytest.mark.skipif(DEVICE != "cuda", reason="counts compiled binaries: needs the GPU compiler")
def test_no_binary_compiles_after_warmup_on_gpu(triton_ops):
    from kernels import triton_fused
    from kernels.triton_attention import paged_attention_kernel, split_reduce_kernel

    heads, kv_heads, head_dim, block_size, hidden, inter = 16, 4, 64, 16, 256, 512
    dtype = torch.bfloat16
    triton_ops.warmup(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                      max_model_len=4096, dtype=dtype, device="cuda", hidden_size=hidden, intermediate_sizes=(inter,))
    kernels = [paged_attention_kernel, split_reduce_kernel, triton_fused.rms_norm_kernel,
               triton_fused.rotary_write_kv_kernel, triton_fused.silu_and_mul_kernel]
    dev = torch.cuda.current_device()

    def binaries():
        return [len(k.device_caches[dev][0]) for k in kernels]

    before = binaries()
    cache = torch.zeros(300, block_size, kv_heads, head_dim, dtype=dtype, device="cuda")
    weight = torch.ones(hidden, dtype=dtype, device="cuda")
    for num_seqs, q_len, width in [(1, 1, 1), (1, 1, 256), (3, 1, 17), (16, 1, 40), (17, 1, 3), (2, 64, 9), (1, 33, 3)]:
        t = num_seqs * q_len
        qkv = torch.randn(t, heads + 2 * kv_heads, head_dim, dtype=dtype, device="cuda")
        x = torch.randn(t, hidden, dtype=dtype, device="cuda")
        triton_ops.rms_norm(x, weight, 1e-6, x)
        cos = torch.ones(t, head_dim // 2, dtype=dtype, device="cuda").unsqueeze(1)
        slots = torch.arange(t, device="cuda")
        qk = triton_ops.rotary_write_kv(qkv[:, :heads + kv_heads], qkv[:, heads + kv_heads:], cos, cos * 0, cache,
                                        cache, slots)
        table = torch.arange(num_seqs * width, dtype=torch.int32, device="cuda").view(num_seqs, width) % 300
        qsl = torch.arange(0, t + 1, q_len, dtype=torch.int32, device="cuda")
        lens = torch.full((num_seqs,), q_len, dtype=torch.int32, device="cuda")  # width * block_size >= q_len
        triton_ops.paged_attention(qk[:, :heads], cache, cache, table, qsl, lens, 0.125)
        triton_ops.silu_and_mul(torch.randn(t, 2 * inter, dtype=dtype, device="cuda"))
    torch.cuda.synchronize()
    assert binaries() == before, "a batch shape compiled a new binary after the warm-up"
