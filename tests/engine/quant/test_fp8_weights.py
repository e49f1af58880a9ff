"""fp8 (e4m3) weights (engine/quant/fp8.py): F8_E4M3 blocks against a numpy reference written from
the e4m3 spec (OCP FP8 E4M3 as torch's float8_e4m3fn: bias 7, 3 mantissa bits, no infinities,
S.1111.111 NaN, max 448): the decoder for every byte, and the quantizer byte for byte (float32
scale amax / 448, q = w / scale saturated to +-448 and rounded to the nearest e4m3, ties to even)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.quant.fp8 import F8_E4M3, FP8_E4M3, quantize_fp8
from engine.quant.quantize import block_format, check_quantizable, describe, quantize

if FP8_E4M3 is None:
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)


def e4m3_value(code: np.ndarray) -> np.ndarray:
    """The spec's value of each byte, float64."""
    code = np.asarray(code, dtype=np.int64)
    e, m = (code >> 3) & 15, code & 7
    magnitude = np.where(e == 0, m * 2.0 ** -9, 2.0 ** (e - 7.0) * (1 + m / 8))
    magnitude = np.where((code & 127) == 127, np.nan, magnitude)
    return np.where(code & 128, -magnitude, magnitude)


GRID = e4m3_value(np.arange(127))  # the non-negative finite values, ascending with their codes


def e4m3_code(v: np.ndarray) -> np.ndarray:
    """float32 values -> the byte of the nearest e4m3 (ties to the even code), saturated at 448."""
    a = np.minimum(np.abs(v.astype(np.float64)), 448.0)
    hi = np.clip(np.searchsorted(GRID, a), 1, 126)
    lo = hi - 1
    d_lo, d_hi = a - GRID[lo], GRID[hi] - a
    code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
    return (code | np.where(np.signbit(v), 128, 0)).astype(np.uint8)


def reference_blocks(w: np.ndarray, per_channel: bool) -> np.ndarray:
    n, k = w.shape
    amax = np.abs(w).max(axis=1, keepdims=True) if per_channel else np.abs(w).max().reshape(1, 1)
    scale = (amax / np.float32(448)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, w / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    codes = e4m3_code(q).reshape(n, k // 32, 32)
    scales = np.broadcast_to(scale, (n, k // 32)).astype("<f4").view(np.uint8).reshape(n, k // 32, 4)
    return np.concatenate([scales, codes], axis=2).reshape(n, -1)


def hard_matrix(k: int = 128) -> np.ndarray:
    """Random rows, a zero row, a constant row, rows of tiny (e4m3-subnormal after scaling) and large
    values, and (row 4, scale 1 per channel) exact ties between e4m3 neighbours."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, k)).astype(np.float32)
    w[0] = 0
    w[1] = -0.3
    w[2, 1:] *= 1e-4  # against w[2, 0]: e4m3 subnormals and zeros
    w[3] *= 1e4
    w[4] = np.float32(448) * (np.arange(k) % 9 - 4) / 4  # amax 448: per channel, scale 1
    w[4, 10:20] = [1.0625, 1.1875, 17, -19, 0.5 * 2 ** -9, 1.5 * 2 ** -9, 432, 440, -1e-12, 2 ** -7]  # ties
    return w


def test_decode_is_the_spec_for_every_byte():
    codes = np.arange(256, dtype=np.uint8).reshape(8, 32)
    blocks = np.concatenate([np.full((8, 1), 0.75, "<f4").view(np.uint8), codes], axis=1)
    got = F8_E4M3.dequantize(torch.from_numpy(blocks)).numpy()
    np.testing.assert_array_equal(got, (e4m3_value(codes) * 0.75).astype(np.float32))


@pytest.mark.parametrize("per_channel", [False, True])
def test_quantizer_bytes_equal_the_reference(per_channel):
    w = hard_matrix()
    got = quantize_fp8(torch.from_numpy(w), per_channel=per_channel)
    assert got.format is F8_E4M3 and got.shape == w.shape
    np.testing.assert_array_equal(got.blocks.numpy(), reference_blocks(w, per_channel))


@pytest.mark.parametrize("per_channel", [False, True])
def test_rounding_error_is_half_an_e4m3_step(per_channel):
    """|w - w'| <= scale * max(|w / scale| / 16, 2^-10): half a step of 3 mantissa bits (of 2^-9
    below 2^-6); the largest weight is exactly 448 * scale, so nothing saturates."""
    w = hard_matrix()
    got = quantize_fp8(torch.from_numpy(w), per_channel=per_channel).dequantize().double().numpy()
    amax = np.abs(w).max(axis=1, keepdims=True) if per_channel else np.abs(w).max()
    scale = (amax / np.float32(448)).astype(np.float64)
    bound = np.maximum(np.abs(w) / 16, scale * 2.0 ** -10) * (1 + 1e-6)
    assert np.all(np.abs(got - w) <= bound)


def test_quantization_fp8_is_per_tensor_in_f8_e4m3_blocks():
    w = torch.from_numpy(hard_matrix())
    assert torch.equal(quantize(w, "fp8").blocks, quantize_fp8(w).blocks)
    assert block_format("fp8") is F8_E4M3
    assert "9 bits per weight" in describe("fp8", 128)
    with pytest.raises(ValueError, match=r"--quantization fp8: this weight has 80 inputs per row, not a multiple"):
        quantize(torch.zeros(4, 80), "fp8")
    with pytest.raises(ValueError, match=r"--quantization fp8: q_proj has 48 inputs"):
        check_quantizable(48, "fp8", 32, "q_proj")
