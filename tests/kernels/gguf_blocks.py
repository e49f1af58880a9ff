"""GGUF blocks for tests: quantize(w, type) for every block format engine.quant reads.

gguf.quants quantizes Q8_0, Q4_0 and Q4_1 but not the K-quants (NotImplementedError), so Q4_K
and Q6_K blocks are written here from the layout gguf.quants.dequantize reads: a plain
min/max (Q4_K) and absmax (Q6_K) quantizer, not llama.cpp's error-minimising search. Its blocks
are checked by dequantizing them with gguf.quants (tests/kernels/test_quant_kernels.py), so the
layout here is tested against the oracle, not assumed.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

QK_K = 256


def _fp16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x rounded to fp16, as float32; its two bytes), so later steps use the value stored."""
    h = x.astype(np.float16)
    return h.astype(np.float32), h.view(np.uint8).reshape(*x.shape[:-1], 2)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0.0, a / np.where(b == 0, 1.0, b))


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[n, k] float32 -> [n, k / 256 * 144] uint8: per sub-block of 32, scale (max - min) / 15 and
    min min(0, min); per super-block, the 8 scales and 8 mins as 6-bit multiples of fp16 d / dmin."""
    n, k = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / 15
    d, d_bytes = _fp16(scale.max(-1, keepdims=True) / 63)
    dmin, dmin_bytes = _fp16(-lo.min(-1, keepdims=True) / 63)
    sc = np.clip(np.rint(_safe_div(scale, d)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(-lo, dmin)), 0, 63).astype(np.uint8)
    eff_scale, eff_min = d * sc, dmin * mn  # what dequantization will use
    q = np.clip(np.rint(_safe_div(x + eff_min[..., None], eff_scale[..., None])), 0, 15).astype(np.uint8)
    packed = np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),   # bytes 0..3: scales 0..3, top bits of scales 4..7
        mn[:, :4] | ((mn[:, 4:] >> 4) << 6),   # bytes 4..7: mins 0..3, top bits of mins 4..7
        (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),  # bytes 8..11: low bits of scales / mins 4..7
    ], axis=-1)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # bytes 32c..: sub-block 2c low, 2c + 1 high
    return np.concatenate([d_bytes, dmin_bytes, packed, qs], axis=-1).reshape(n, k // QK_K * 144)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """[n, k] float32 -> [n, k / 256 * 210] uint8: per group of 16, a signed scale that maps the
    largest-magnitude weight to -32; per super-block, the 16 scales as int8 multiples of fp16 d."""
    n, k = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)
    at_max = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]
    scale = at_max / -32
    d, d_bytes = _fp16(np.take_along_axis(scale, np.abs(scale).argmax(-1)[..., None], -1) / -128)
    sc = np.clip(np.rint(_safe_div(scale, d)), -128, 127).astype(np.int8)
    q = np.clip(np.rint(_safe_div(x, (d * sc)[..., None])), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # (half h, quarter t, l)
    low, high = q & 0x0F, q >> 4
    ql = (low[:, :, :2] | (low[:, :, 2:] << 4)).reshape(-1, 128)  # quarters 2, 3 in the high nibbles
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=-1).reshape(n, k // QK_K * 210)


_OWN = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}


def quantize(w: np.ndarray, fmt: str) -> np.ndarray:
    """[n, k] float32 -> GGUF blocks of type `fmt`, uint8 [n, row bytes]."""
    if fmt in _OWN:
        return _OWN[fmt](np.ascontiguousarray(w, dtype=np.float32))
    return gguf_quantize(w, GGMLQuantizationType[fmt])
