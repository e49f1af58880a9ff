"""The Triton weight-only matmul on GGUF blocks (kernels/triton_quant.py) against its oracle:
gguf.quants.dequantize (llama.cpp's own decoder) of the same bytes (fp8's F8_E4M3 blocks, which
GGUF lacks: torch's e4m3 decoding, checked against the spec in tests/engine/quant/test_fp8_weights.py),
rounded to x's dtype as engine.quant rounds them, then a float64 matmul; and the engine on the
triton backend with
`--quantization int8 | int4` against the same engine on the torch backend (dequantize-then-F.linear).

Triton runs under the interpreter on CPU (tests/kernels/conftest.py; bfloat16 via its patch). The
shapes are odd (N = 45: column tiles part-filled; K of 5 blocks: the last K step part-filled) and
each split-K path is forced, empty splits included.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.quant import FORMATS, reference_linear
from engine.quant.fp8 import F8_E4M3, quantize_fp8
from tests.engine.engine_runs import engine_greedy
from tests.kernels.gguf_blocks import quantize
from tests.kernels.kernel_cases import DEVICE, DTYPES
from tests.tiny_model import build_tiny_model

ALL_FORMATS = {**FORMATS, F8_E4M3.name: F8_E4M3}
FORMAT_NAMES = sorted(ALL_FORMATS)
# Byte offsets of each format's fp16 fields: random blocks get finite values there.
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}
# |got - want| <= RTOL * (|x| @ |w|^T + |bias|): float32 accumulation over K <= 1280 terms, plus
# (16-bit) one rounding of the output.
RTOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _k(fmt: str, blocks: int) -> int:
    return blocks * ALL_FORMATS[fmt].block_size


def _decode(blocks: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == F8_E4M3.name:
        return F8_E4M3.dequantize(torch.from_numpy(blocks)).numpy()
    return dequantize(blocks, GGMLQuantizationType[fmt])


def quantized_weight(fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """(GGUF blocks uint8 [n, row bytes] of a random matrix, their gguf-dequantized float32 [n, k])."""
    w = np.random.default_rng(seed).standard_normal((n, k), dtype=np.float32) / np.sqrt(k)
    w[: n // 3] *= 0.01  # small scales too: fp16 scales near their subnormal range
    if fmt == F8_E4M3.name:  # a scale per row: the small rows keep their precision
        blocks = quantize_fp8(torch.from_numpy(w), per_channel=True).blocks.numpy()
    else:
        blocks = quantize(w, fmt)
    return torch.from_numpy(blocks.copy()), _decode(blocks, fmt)


def random_blocks(fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """Every byte random (each bit of every packed field both ways) save the fp16 fields, which hold
    random finite values, normal and subnormal."""
    rng = np.random.default_rng(seed)
    f = ALL_FORMATS[fmt]
    blocks = rng.integers(0, 256, (n, k // f.block_size, f.block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS.get(fmt, ()):
        magnitude = 10.0 ** rng.integers(-7, -1, blocks.shape[:2])
        half = (rng.standard_normal(blocks.shape[:2]) * magnitude).astype(np.float16)
        blocks[..., offset:offset + 2] = half.view(np.uint8).reshape(*blocks.shape[:2], 2)
    if fmt == F8_E4M3.name:  # a float32 scale from 1e-40 (subnormal) up; e4m3 bytes but NaN's two
        scale = rng.standard_normal(blocks.shape[:2]) * 10.0 ** rng.integers(-40, 2, blocks.shape[:2])
        blocks[..., :4] = scale.astype(np.float32).view(np.uint8).reshape(*blocks.shape[:2], 4)
        payload = blocks[..., 4:]
        payload[(payload & 0x7F) == 0x7F] &= 0xFE
    blocks = blocks.reshape(n, -1)
    return torch.from_numpy(blocks), _decode(blocks, fmt)


def check(got: torch.Tensor, x: torch.Tensor, w: np.ndarray, bias: torch.Tensor | None) -> None:
    """got against the float64 matmul of x and w rounded to x.dtype (what the kernel multiplies)."""
    assert got.dtype == x.dtype and got.shape == (*x.shape[:-1], w.shape[0])
    w = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).to(x.dtype).double()
    x64 = x.cpu().double()
    b64 = bias.cpu().double() if bias is not None else torch.zeros(w.shape[0], dtype=torch.float64)
    want = x64 @ w.T + b64
    bound = RTOL[x.dtype] * (x64.abs() @ w.abs().T + b64.abs()) + 1e-30
    err = (got.cpu().double() - want).abs()
    worst = (err / bound).max().item()
    assert worst <= 1, f"error {worst:.3g}x the bound (max abs error {err.max().item():.3g})"


@pytest.fixture(scope="module")
def triton_quant(triton_ops):
    from kernels import triton_quant

    return triton_quant


def test_the_kernel_covers_every_engine_format(triton_quant):
    assert set(triton_quant.FORMATS) == set(ALL_FORMATS)
    for name, (_, group, block, block_bytes) in triton_quant.FORMATS.items():
        assert (block, block_bytes) == (ALL_FORMATS[name].block_size, ALL_FORMATS[name].block_bytes), name
        assert block % group == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_quant_linear_matches_dequantized_matmul(triton_quant, fmt, m, dtype):
    """Decode (16-row tiles, 128-wide K steps) and small-prefill (32-row tiles) shapes, with bias."""
    k = _k(fmt, 5 if ALL_FORMATS[fmt].block_size == 32 else 2)
    blocks, w = quantized_weight(fmt, 45, k, seed=m)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(45, generator=gen).to(dtype)
    got = triton_quant.quant_linear(x.to(DEVICE), blocks.to(DEVICE), fmt, bias.to(DEVICE))
    check(got, x, w, bias)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_every_bit_of_every_packed_field(triton_quant, fmt):
    """Random block bytes: every scale / min / nibble bit both ways (Q4_K's 6-bit scales and mins,
    Q6_K's high bits), fp16 scales from subnormal to 0.01; 64-row prefill tiles, no bias."""
    k = _k(fmt, 7 if ALL_FORMATS[fmt].block_size == 32 else 3)
    blocks, w = random_blocks(fmt, 70, k, seed=1)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(2))
    got = triton_quant.quant_linear(x.to(DEVICE), blocks.to(DEVICE), fmt)
    check(got, x, w, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1", "Q6_K", "F8_E4M3"])
def test_split_k(triton_quant, fmt, num_splits, dtype):
    """K split over programs, float32 partials summed after, bias added once: 8 splits of Q8_0's
    and Q4_1's 3 K steps leave splits empty (they must write zeros, not leave garbage)."""
    k = _k(fmt, 12 if ALL_FORMATS[fmt].block_size == 32 else 3)
    blocks, w = quantized_weight(fmt, 45, k, seed=num_splits)
    gen = torch.Generator().manual_seed(num_splits)
    x = torch.randn(3, k, generator=gen).to(dtype)
    bias = torch.randn(45, generator=gen).to(dtype)
    got = triton_quant.quant_linear(x.to(DEVICE), blocks.to(DEVICE), fmt, bias.to(DEVICE), num_splits=num_splits)
    check(got, x, w, bias)


def test_leading_dims_strided_rows_and_empty_batches(triton_quant):
    """x [..., K] with a row stride wider than K (a view of a wider tensor), and no tokens at all."""
    blocks, w = quantized_weight("Q4_1", 33, 96)
    wide = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(0))
    x = wide[..., :96]
    check(triton_quant.quant_linear(x.to(DEVICE), blocks.to(DEVICE), "Q4_1"), x, w, None)
    assert triton_quant.quant_linear(torch.empty(0, 96, device=DEVICE), blocks.to(DEVICE), "Q4_1").shape == (0, 33)


def test_block_format_linear_dispatches_to_the_kernel(triton_quant, monkeypatch):
    """BlockFormat.linear on backend "triton" runs the Triton kernel; "torch" stays the reference."""
    calls = []
    kernel = triton_quant.quant_linear
    monkeypatch.setattr(triton_quant, "quant_linear", lambda *a, **kw: calls.append(a[2]) or kernel(*a, **kw))
    blocks, _ = quantized_weight("Q8_0", 40, 64)
    x = torch.randn(2, 64, device=DEVICE)
    fmt = FORMATS["Q8_0"]
    got = fmt.linear(x, blocks.to(DEVICE), None, "triton")
    assert calls == ["Q8_0"]
    torch.testing.assert_close(got, reference_linear(x, blocks.to(DEVICE), fmt), atol=1e-5, rtol=1e-5)
    fmt.linear(x, blocks.to(DEVICE), None, "torch")
    assert calls == ["Q8_0"]


def test_split_heuristic(triton_quant):
    """Splits only while the SMs are short of programs and each split keeps several K steps."""
    split_k = triton_quant.split_k
    assert split_k(64, 16, 1) == 1  # the interpreter's one "SM"
    assert split_k(64, 16, 132) == 4  # a 2048-row decode GEMV on an H100: 256 programs
    assert split_k(64, 4, 132) == 1  # too few K steps to share
    assert split_k(1, 10_000, 132) == triton_quant.MAX_SPLIT_K
    assert split_k(600, 64, 132) == 1  # a prefill fills the GPU without splitting


def test_warmup_launches_each_plan_once_per_layer_shape(triton_quant, monkeypatch):
    """Distinct (format, shape, bias) layers only; per layer, the first row count of each launch plan:
    on one SM (the interpreter's count, set here on a GPU too) nothing splits, so one per tile size
    (1, 17 and 65 rows)."""
    from kernels import triton_ops

    monkeypatch.setattr(triton_ops, "_num_sms", lambda device: 1)
    rows = []
    kernel = triton_quant.quant_linear

    def recorded(x, blocks, fmt, bias=None):
        rows.append((fmt, x.shape[0], bias is not None))
        return kernel(x, blocks, fmt, bias)

    monkeypatch.setattr(triton_quant, "quant_linear", recorded)
    q4, q8 = quantized_weight("Q4_1", 45, 96)[0].to(DEVICE), quantized_weight("Q8_0", 40, 64)[0].to(DEVICE)
    layers = [("Q4_1", q4, None), ("Q4_1", q4.clone(), None), ("Q8_0", q8, torch.zeros(40, device=DEVICE))]
    assert triton_quant.warmup(layers, torch.float32, DEVICE, max_num_tokens=100) == 6
    assert rows == [("Q4_1", m, False) for m in (1, 17, 65)] + [("Q8_0", m, True) for m in (1, 17, 65)]


# ---- the engine: --quantization int8 / int4 on the triton backend ----------------------------------

@pytest.mark.slow  # ~15 s each under the interpreter
@pytest.mark.parametrize("method, group_size", [("int8", 128), ("int4", 32)])
def test_engine_greedy_triton_equals_torch(triton_quant, tmp_path, monkeypatch, method, group_size):
    """A tiny Llama quantized at load: the triton backend (attention and the quantized matmuls in
    Triton, on the blocks' repacked copies) gives the greedy tokens of the torch backend
    (dequantize, then F.linear)."""
    path = build_tiny_model(tmp_path / "tiny", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2)
    from kernels import triton_quant_packed

    formats = []  # the triton backend multiplies the repacked copies of Q8_0 / Q4_1 blocks
    kernel = triton_quant_packed.packed_linear
    monkeypatch.setattr(triton_quant_packed, "packed_linear",
                        lambda x, w, *a, **kw: formats.append(w.format) or kernel(x, w, *a, **kw))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 21)]
    # DEVICE: the Triton kernels are compiled for CUDA where there is a GPU and take no CPU tensors.
    config = dict(quantization=method, quantization_group_size=group_size, dtype="float32", device=DEVICE,
                  num_kv_blocks=32, max_model_len=128, max_num_batched_tokens=24)
    got = engine_greedy(path, prompts, 6, attention_backend="triton", **config)
    assert set(formats) == {"Q8_0" if method == "int8" else "Q4_1"}
    assert got == engine_greedy(path, prompts, 6, attention_backend="torch", **config)
