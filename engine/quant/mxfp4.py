"""MXFP4 (OCP microscaling FP4), as gpt-oss's released checkpoints store their experts: blocks of 32
e2m1 values (two 4-bit codes a byte, the low nibble first) sharing one e8m0 scale (2 ** (s - 127)).
Dequantized to float at load; the experts then run in the model's dtype."""

from __future__ import annotations

import torch

# The 16 e2m1 values by code: sign bit, two exponent bits, one mantissa bit.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., groups, 16], scales uint8 [..., groups] -> [..., groups * 32] in `dtype`."""
    blocks, scales = torch.as_tensor(blocks), torch.as_tensor(scales)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: blocks "
                         "must be [..., groups, 16] bytes and scales [..., groups]")
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    values = torch.stack([table[(codes & 0x0F).long()], table[(codes >> 4).long()]], dim=-1)  # low nibble first
    values = torch.ldexp(values.flatten(-2), (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.flatten(-2).to(dtype)
