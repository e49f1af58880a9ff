"""GGUF's block-quantized weight formats: how a weight is stored and the matmul that consumes it.

A quantized weight [N, K] is kept exactly as the GGUF file stores it: uint8 [N, K / 32 * block
bytes], each row its K / 32 blocks in order, each block a scale (and a min) in fp16 followed by
its 32 quantized weights (kernels/cpu_quant.cpp draws each layout). Rows are independent, so a
tensor-parallel shard of output rows is a slice of rows, and one of input columns a slice of
whole blocks.

Each format's `dequantize` is pure torch (any device) and reproduces gguf.quants.dequantize
bit for bit (tests/kernels/test_quant_kernels.py); it is the torch backend's matmul (dequantize,
then F.linear) and the oracle the cpu backend's C++ kernels are tested against.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

BLOCK_SIZE = 32  # weights per block in every format here (Q8_0, Q4_0, Q4_1)
# GGUF float types: loaded as today, dequantized (converted) to the model's dtype.
FLOAT_TYPES = ("F32", "F16", "BF16")


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at byte `offset` of every block, as float32 [..., nb, 1]."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes of nibbles -> the block's 32 values: low nibbles first, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _dequantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[..., 2:].contiguous().view(torch.int8).float() * _half(b, 0)


def _dequantize_q4_0(b: torch.Tensor) -> torch.Tensor:
    return _half(b, 0) * (_nibbles(b[..., 2:]).to(torch.int8) - 8).float()


def _dequantize_q4_1(b: torch.Tensor) -> torch.Tensor:
    # d * q, then + m: gguf's two float32 roundings, not one fused multiply-add.
    return _half(b, 0) * _nibbles(b[..., 4:]).float() + _half(b, 2)


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block format: its name (the GGUF type name), its block's bytes, its dequantization."""

    name: str
    block_bytes: int
    _dequantize: object  # (blocks [..., nb, block_bytes] uint8) -> float32 [..., nb, 32]

    block_size: int = BLOCK_SIZE

    def row_bytes(self, in_features: int) -> int:
        assert in_features % self.block_size == 0, f"{in_features} inputs are not whole blocks of {self.block_size}"
        return in_features // self.block_size * self.block_bytes

    def in_features(self, row_bytes: int) -> int:
        return row_bytes // self.block_bytes * self.block_size

    def dequantize(self, blocks: torch.Tensor) -> torch.Tensor:
        """uint8 [N, row bytes] -> float32 [N, K], exactly gguf.quants.dequantize's values."""
        n = blocks.shape[0]
        return self._dequantize(blocks.reshape(n, -1, self.block_bytes)).reshape(n, -1)

    def linear(self, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, backend: str) -> torch.Tensor:
        """x @ dequantize(blocks)^T + bias in x.dtype: the cpu backend's C++ kernels, else the
        reference (dequantize each call, then F.linear: correct anywhere, not fast)."""
        if backend == "cpu" and _cpu_kernels() is not None:
            return _cpu_kernels().linear(x, blocks, self.name, bias)
        return reference_linear(x, blocks, self, bias)


def reference_linear(x: torch.Tensor, blocks: torch.Tensor, fmt: BlockFormat,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, fmt.dequantize(blocks).to(x.dtype), bias)


FORMATS = {f.name: f for f in (
    BlockFormat("Q8_0", 34, _dequantize_q8_0),
    BlockFormat("Q4_0", 18, _dequantize_q4_0),
    BlockFormat("Q4_1", 20, _dequantize_q4_1),
)}

_cpu = []  # [module or None], filled on the first cpu-backend matmul


def _cpu_kernels():
    if not _cpu:
        from kernels import cpu_quant

        try:
            cpu_quant.load_quant()
            _cpu.append(cpu_quant)
        except RuntimeError as e:
            logger.warning("quantized CPU kernels unavailable (%s); quantized matmuls dequantize each call", e)
            _cpu.append(None)
    return _cpu[0]
