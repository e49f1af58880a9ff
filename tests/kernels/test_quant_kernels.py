"""GGUF block-quantized matmuls (kernels/cpu_quant.cpp, engine/quant) against their oracle:
gguf.quants.dequantize, then a float64 matmul."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.quant import FORMATS, QuantizedTensor, reference_linear
from kernels import cpu_build, cpu_quant

FORMAT_NAMES = sorted(FORMATS)


def _weight(fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(GGUF blocks uint8 [n, row bytes], their dequantized float32 [n, k]) of a random matrix."""
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32)
    w[: n // 2] *= 0.01  # rows of small scales too: fp16 scales near their subnormal range
    blocks = quantize(w, GGMLQuantizationType[fmt])
    return torch.from_numpy(blocks.copy()), torch.from_numpy(dequantize(blocks, GGMLQuantizationType[fmt]).copy())


def _cpu_kernels_or_skip():
    error = None
    try:
        cpu_build.load_quant()
    except RuntimeError as e:
        error = e
    if error is not None:
        pytest.skip(f"quantized CPU kernels unavailable: {error}")


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_torch_dequantize_is_gguf_bit_for_bit(fmt):
    blocks, want = _weight(fmt, 7, 96)
    got = FORMATS[fmt].dequantize(blocks)
    assert got.dtype == torch.float32 and torch.equal(got, want)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_cpu_dequantize_matches_gguf(fmt):
    _cpu_kernels_or_skip()
    blocks, want = _weight(fmt, 19, 160)
    assert torch.equal(cpu_quant.dequantize(blocks, fmt), want)
    assert torch.equal(cpu_quant.dequantize(blocks, fmt, torch.bfloat16), want.bfloat16())


def _tolerance(x: torch.Tensor, w: torch.Tensor, rel: float) -> torch.Tensor:
    """rel * (|x| @ |w|^T): the error bound of a dot product whose terms are each off by rel."""
    return rel * (x.abs().double() @ w.abs().double().T) + 1e-6


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [32, 96, 608])
def test_cpu_linear_matches_dequantized_reference(fmt, dtype, k):
    _cpu_kernels_or_skip()
    n = 37  # odd: a partial last work item of output rows
    blocks, w = _weight(fmt, n, k, seed=k)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    for m in (1, 3, 17, 64):  # decode, the register kernel's row groups, and the dequantize-then-GEMM path
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        got = cpu_quant.linear(x, blocks, fmt, bias)
        want = x.double() @ w.double().T + bias.double()
        assert got.dtype == dtype and got.shape == (m, n)
        # float32: summation order only. bfloat16: the output's rounding, and above
        # DEQUANT_GEMM_ROWS the weights' rounding to bfloat16 for the GEMM.
        rel = 1e-5 if dtype == torch.float32 else 2 * 2.0 ** -8
        assert ((got.double() - want).abs() <= _tolerance(x, w, rel) + rel * bias.double().abs()).all(), (m, fmt)


def test_cpu_linear_takes_leading_dims():
    _cpu_kernels_or_skip()
    blocks, w = _weight("Q4_1", 5, 64)
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(cpu_quant.linear(x, blocks, "Q4_1"), x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_q8_activation_kernel_within_int8_rounding(fmt):
    """linear_q8 (int8 activations per block, integer dots) is off by the activations' rounding
    only: at most half a quantization step (block amax / 127 / 2) per activation."""
    _cpu_kernels_or_skip()
    blocks, w = _weight(fmt, 33, 128)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(5))
    step = x.reshape(5, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(5, 128) / 127
    bound = (step.double() / 2 + 1e-6 * x.abs().double()) @ w.abs().double().T + 1e-5
    got = cpu_quant.linear_q8(x, blocks, fmt)
    assert ((got.double() - x.double() @ w.double().T).abs() <= bound).all()


def test_cpu_linear_rejects_a_misshapen_weight():
    _cpu_kernels_or_skip()
    blocks, _ = _weight("Q8_0", 4, 64)
    with pytest.raises(RuntimeError, match="row"):
        cpu_quant.linear(torch.randn(1, 96), blocks, "Q8_0")
    with pytest.raises(ValueError, match="supported"):
        cpu_quant.linear(torch.randn(1, 64), blocks, "Q5_0")


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_format_linear_per_backend(fmt):
    """The torch backend's matmul is the reference itself; the cpu backend's agrees with it."""
    blocks, w = _weight(fmt, 9, 64)
    x = torch.randn(2, 64)
    torch.testing.assert_close(FORMATS[fmt].linear(x, blocks, None, "torch"), x @ w.T, rtol=0, atol=0)
    torch.testing.assert_close(reference_linear(x, blocks, FORMATS[fmt]), x @ w.T, rtol=0, atol=0)
    torch.testing.assert_close(FORMATS[fmt].linear(x, blocks, None, "cpu"), x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_quantized_tensor_narrows_on_whole_blocks(fmt):
    blocks, w = _weight(fmt, 6, 128)
    t = QuantizedTensor(blocks, FORMATS[fmt])
    assert t.shape == (6, 128)
    assert torch.equal(t.narrow(0, 2, 3).dequantize(), w[2:5])
    assert torch.equal(t.narrow(1, 64, 64).dequantize(), w[:, 64:])
    with pytest.raises(ValueError, match="whole blocks"):
        t.narrow(1, 16, 64)
