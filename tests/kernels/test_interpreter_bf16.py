"""Guard: bfloat16 kernels compute as on a GPU, here and under Triton's interpreter (interpreter_bf16).

Without the interpreter patch a bf16 tl.dot multiplies raw bit patterns and a float32 -> bf16 cast
truncates; every bf16 kernel case would then compare garbage (or fail). These checks fail if the
patch stops taking effect, e.g. after a triton upgrade renames what it replaces. On a GPU they
check the compiled kernels against the same float64 truths.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels import interpreter_bf16
from tests.kernels.kernel_cases import DEVICE

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b))  # float32 accumulator


@triton.jit
def _cast_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.bfloat16))


@triton.jit
def _arith_kernel(a_ptr, b_ptr, sum_ptr, prod_ptr, max_ptr, neg_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    a, b = tl.load(a_ptr + offs), tl.load(b_ptr + offs)  # bf16, computed in bf16
    tl.store(sum_ptr + offs, a + b)
    tl.store(prod_ptr + offs, a * b)
    tl.store(max_ptr + offs, tl.maximum(a, b))
    tl.store(neg_ptr + offs, -a)


def test_patch_is_installed_under_the_interpreter(triton_ops):
    if not triton_ops.INTERPRETED:
        pytest.skip("compiled kernels: bf16 is native, nothing to patch")
    assert interpreter_bf16.installed(), "tests/kernels/conftest.py did not install interpreter_bf16"


def test_bf16_dot_matches_float64(triton_ops):
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 32, generator=gen).bfloat16()
    b = torch.randn(32, 16, generator=gen).bfloat16()
    c = torch.full((16, 16), float("nan"), device=DEVICE)
    _dot_kernel[(1,)](a.to(DEVICE), b.to(DEVICE), c, M=16, N=16, K=32)
    # bf16 products are exact in float32: only float32 summation error separates it from float64.
    want = a.double() @ b.double()
    torch.testing.assert_close(c.cpu().double(), want, atol=1e-5, rtol=1e-5)


def test_float32_to_bf16_rounds_to_nearest_even(triton_ops):
    one = 1.0
    ulp = 2.0 ** -7  # bf16's spacing at 1
    values = [one + ulp * 0.75, one + ulp * 0.5, one + ulp * 1.5, -(one + ulp * 0.75),  # up, tie-even, tie-up
              one + ulp * 0.25, 3.0e38, -3.4e38, float("inf"), float("-inf"), 0.0, -0.0,
              1e-39, -3e-40, 2.0 ** -126 * 0.75, 65504.0, 123.456]
    x = torch.tensor(values + [0.0] * (32 - len(values)), dtype=torch.float32)
    y = torch.empty(32, dtype=torch.bfloat16, device=DEVICE)
    _cast_kernel[(1,)](x.to(DEVICE), y, N=32)
    assert torch.equal(y.cpu().view(torch.int16), x.bfloat16().view(torch.int16))  # torch rounds to nearest even
    nan = torch.full((32,), float("nan"))
    _cast_kernel[(1,)](nan.to(DEVICE), y, N=32)
    assert y.isnan().all()


def test_bf16_arithmetic(triton_ops):
    gen = torch.Generator().manual_seed(1)
    a = (torch.randn(64, generator=gen) * 3).bfloat16()
    b = (torch.randn(64, generator=gen) * 3).bfloat16()
    outs = [torch.empty(64, dtype=torch.bfloat16, device=DEVICE) for _ in range(4)]
    _arith_kernel[(1,)](a.to(DEVICE), b.to(DEVICE), *outs, N=64)
    # float32 holds the exact sum and product of two bf16 values; one rounding to bf16 follows.
    for got, want in zip(outs, ((a.float() + b.float()).bfloat16(), (a.float() * b.float()).bfloat16(),
                                torch.maximum(a, b), -a)):
        assert torch.equal(got.cpu(), want)
