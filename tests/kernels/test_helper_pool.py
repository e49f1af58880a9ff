"""kernels/cpu_quant.cpp's helper pool serving kernels/cpu_ops.cpp's loops too (cpu_build.set_helpers):
the caller and its helpers take each loop's chunks, and every output element is still one thread's
work, so the results are torch's OpenMP team's bit for bit. The team here is 1 + h threads and the
pool one thread plus h helpers: both count as many threads, so attention splits a lone row's keys
alike (it splits one row on two KV heads for two threads, not for one)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu_build, cpu_ops
from tests.kernels.kernel_cases import make_batch
from tests.kernels.test_cpu_kernels import to_cpu_layout

if cpu_build.available() is not None:
    pytest.skip(f"CPU KERNELS NOT TESTED: they did not build ({cpu_build.available()})", allow_module_level=True)


def _attention(b):
    b = to_cpu_layout(b)
    return lambda: kernels.paged_attention(*b.args(), backend="cpu")


def _cases():
    """Each op of cpu_ops.cpp the pool runs, on inputs large enough to take several chunks."""
    gen = torch.Generator().manual_seed(0)

    def bf16(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    n = 150  # rows: past every op's grain (rotary's: 64 tokens), so each takes several chunks
    x, res, w, q = bf16(n, 576), bf16(n, 576), bf16(576), bf16(n, 9, 64)
    cos, sin = bf16(n, 32), bf16(n, 32)
    gate_up = bf16(n, 2 * 1536)
    logits = torch.randn(n, 4999, generator=gen)
    cache = kernels.allocate_kv_cache(16, 16, 3, 64, torch.bfloat16, "cpu", backend="cpu")
    kv = bf16(n, 3, 64), bf16(n, 3, 64)
    slots = torch.randperm(256, generator=gen)[:n]

    def write_kv():
        k, v = (c.zero_() for c in cache)
        cpu_ops.write_kv(*kv, k, v, slots)
        return torch.cat([k.flatten(), v.flatten()])

    return {
        "rms_norm": lambda: torch.cat(cpu_ops.rms_norm(x, w, 1e-5, residual=res)),
        "rotary": lambda: cpu_ops.apply_rotary(q.clone(), cos, sin),
        "silu_and_mul": lambda: cpu_ops.silu_and_mul(gate_up),
        "argmax": lambda: cpu_ops.argmax(logits),
        "write_kv": write_kv,
        "attention, decode rows": _attention(make_batch([1] * 9, [5, 17, 40, 64, 100, 3, 33, 90, 128],
                                                        dtype=torch.bfloat16, seed=1)),
        "attention, prefill rows": _attention(make_batch([30, 7], [30, 70], dtype=torch.bfloat16, seed=2)),
        "attention, a lone row split": _attention(make_batch([1], [1000], num_kv_heads=2, dtype=torch.bfloat16,
                                                             seed=3)),
    }


@pytest.mark.parametrize("helpers", [1, 3])  # 3: more threads than this machine's CPUs, chunks raced for
def test_cpu_ops_loops_through_the_pool_give_the_teams_bits(helpers):
    quant = cpu_build.load_quant()  # the pool lives there: with both loaded, cpu_ops' loops go through it
    threads = torch.get_num_threads()
    cases = _cases()
    try:
        torch.set_num_threads(1 + helpers)
        want = {name: run() for name, run in cases.items()}
        torch.set_num_threads(1)
        cpu_build.set_helpers(helpers)
        for name, run in cases.items():
            before = quant.helper_chunks()
            for _ in range(200):  # until a helper has taken part (none is waited for)
                got = run()
                assert torch.equal(got, want[name]), name
                if quant.helper_chunks() > before:
                    break
            assert quant.helper_chunks() > before, f"{name}: no helper took a chunk in 200 calls"
    finally:
        cpu_build.set_helpers(0)
        torch.set_num_threads(threads)
    assert quant.helpers() == 0


@pytest.mark.parametrize("rows", [17, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_quantized_matmuls_through_the_pool_give_the_teams_bits(rows, with_bias):
    """Past the register kernel's rows, bf16 activations on a CPU without bf16 brgemm take
    dequantize + oneDNN's GEMM: with helpers, a GEMM per slice of weight rows on each thread
    (linear_dequant_gemm), which must give F.linear's bits on the whole weight. Layers of the
    default model's shapes and a 49,152-row head."""
    from kernels import cpu_quant
    from tests.kernels.test_quant_kernels import _weight

    gen = torch.Generator().manual_seed(rows)
    threads = torch.get_num_threads()
    for n, k in [(960, 576), (576, 1536), (49152, 576)]:
        blocks, _ = _weight("Q4_1", n, k, seed=n)
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
        bias = torch.randn(n, generator=gen).to(torch.bfloat16) if with_bias and n < 10000 else None
        try:
            torch.set_num_threads(2)
            want = cpu_quant.linear(x, blocks, "Q4_1", bias)
            torch.set_num_threads(1)
            cpu_build.set_helpers(1)
            got = cpu_quant.linear(x, blocks, "Q4_1", bias)
        finally:
            cpu_build.set_helpers(0)
            torch.set_num_threads(threads)
        assert torch.equal(got, want), (n, k)
