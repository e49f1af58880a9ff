"""fp8 (e4m3) weights, weight-only, as vLLM's Fp8LinearMethod keeps them: w ~ e4m3 * scale with a
float32 scale per tensor (`--quantization fp8`: scale = amax(|w|) / 448, vLLM's dynamic
quantization) or per output channel (scale = amax(|row|) / 448, compressed-tensors' fp8 channel
strategy), q = w / scale in float32, saturated to +-448 and rounded to nearest even (torch's cast).

Kept in a block layout like GGUF's, so the layers, the tensor-parallel slicing and the loaders
handle it as they handle Q8_0: F8_E4M3 blocks of 32 weights, a float32 scale (little-endian) then
32 e4m3 bytes, the tensor's or the row's scale repeated in each of its blocks. 36 bytes per 32
weights: 9 bits per weight stored (vLLM's layout: 8 bits and one float32 per tensor or row).

The triton backend's kernel reads the blocks directly (kernels/triton_quant.py, decoding e4m3 in
integer arithmetic, so any GPU runs it, Ampere too); the torch backend dequantizes them (the
oracle); the cpu backend has no fp8 kernel (kernels/cpu_quant.py raises a ValueError naming the format).
"""

from __future__ import annotations

import torch

from engine.quant.formats import BLOCK_SIZE, BlockFormat
from engine.quant.tensor import QuantizedTensor

FP8_E4M3 = getattr(torch, "float8_e4m3fn", None)  # None in a torch without float8 dtypes
FP8_MAX = 448.0  # e4m3's largest finite value
BLOCK_BYTES = 4 + BLOCK_SIZE
FP8_BITS_PER_WEIGHT = 8 * BLOCK_BYTES / BLOCK_SIZE  # 9.0


def _need_fp8_dtype() -> None:
    if FP8_E4M3 is None:
        raise ValueError(f"--quantization fp8 needs torch's float8_e4m3fn dtype, which this torch "
                         f"({torch.__version__}) lacks (torch >= 2.1 has it)")


def _dequantize_f8_e4m3(b: torch.Tensor) -> torch.Tensor:
    """[..., nb, 36] -> float32 [..., nb, 32]: e4m3 * scale, one float32 rounding."""
    _need_fp8_dtype()
    scale = b[..., :4].contiguous().view(torch.float32)
    return b[..., 4:].contiguous().view(FP8_E4M3).float() * scale


F8_E4M3 = BlockFormat("F8_E4M3", BLOCK_BYTES, _dequantize_f8_e4m3)


def pack_f8_e4m3(scale: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """F8_E4M3 blocks: scale float32 [N, K / 32] (each block's), q e4m3 [N, K] -> uint8 [N, K / 32 * 36]."""
    n, k = q.shape
    nb = k // BLOCK_SIZE
    scales = scale.to(torch.float32).contiguous().view(torch.uint8).reshape(n, nb, 4)
    quants = q.contiguous().view(torch.uint8).reshape(n, nb, BLOCK_SIZE)
    return torch.cat([scales, quants], dim=-1).reshape(n, -1)


def quantize_fp8(w: torch.Tensor, per_channel: bool = False) -> QuantizedTensor:
    """A float [N, K] weight as e4m3 with a float32 scale per tensor (or per row), in F8_E4M3 blocks.
    A zero tensor (row) gets scale 0 and q 0."""
    _need_fp8_dtype()
    n, k = w.shape
    assert k % BLOCK_SIZE == 0, f"{k} inputs are not whole blocks of {BLOCK_SIZE}"
    x = w.to(torch.float32)
    amax = x.abs().amax(dim=1, keepdim=True) if per_channel else x.abs().amax().reshape(1, 1)
    scale = amax / FP8_MAX
    q = (x / torch.where(scale > 0, scale, 1.0)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_E4M3)
    return QuantizedTensor(pack_f8_e4m3(scale.expand(n, k // BLOCK_SIZE), q), F8_E4M3)
