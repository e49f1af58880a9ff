"""GGUF's block-quantized weight formats: how a weight is stored and the matmul that consumes it.

A quantized weight [N, K] is kept exactly as the GGUF file stores it: uint8 [N, K / block_size *
block_bytes], each row its blocks in order. Q8_0, Q4_0 and Q4_1 blocks hold 32 weights: a scale
(and a min) in fp16, then the quantized weights. The K-quants Q4_K and Q6_K hold 256 (a
super-block): sub-blocks of 32 (Q4_K) or 16 (Q6_K) weights with their own small integer scales,
under one fp16 scale (kernels/cpu_quant.cpp draws each layout). Rows are independent, so a
tensor-parallel shard of output rows is a slice of rows, and one of input columns a slice of
whole blocks.

Each format's `dequantize` is pure torch (any device) and reproduces gguf.quants.dequantize
bit for bit (tests/kernels/test_quant_kernels.py); it is the torch backend's matmul (dequantize,
then F.linear) and the oracle the cpu backend's C++ kernels are tested against.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

BLOCK_SIZE = 32  # weights per block of Q8_0, Q4_0 and Q4_1 (and per Q4_K sub-block)
QK_K = 256  # weights per K-quant super-block (Q4_K, Q6_K)
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


def _widen_bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).float()


def _dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    """[..., nb, 144] -> [..., nb, 256]: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for the
    8 sub-blocks of 32, then 128 bytes of nibbles (bytes 32c.. hold sub-block 2c low, 2c + 1 high)."""
    s0, s1, s2 = b[..., 4:8], b[..., 8:12], b[..., 12:16]
    # Sub-blocks 0..3 keep their 6 bits in bytes 0..3 (scales) and 4..7 (mins); 4..7 take their low
    # 4 bits from bytes 8..11's nibbles and their top 2 from the spare top bits of bytes 0..7.
    scales = torch.cat([s0 & 63, (s2 & 0x0F) | ((s0 >> 6) << 4)], dim=-1).float()
    mins = torch.cat([s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4)], dim=-1).float()
    qs = b[..., 16:].unflatten(-1, (4, 1, 32))
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-2).flatten(-3, -2).float()  # [..., nb, 8, 32]
    d = (_half(b, 0) * scales).unsqueeze(-1)
    dm = (_half(b, 2) * mins).unsqueeze(-1)
    return (d * q - dm).flatten(-2)


def _dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    """[..., nb, 210] -> [..., nb, 256]: 128 bytes of low nibbles, 64 bytes of 2-bit high parts,
    16 int8 scales (one per 16 weights), fp16 d; each half of 128 weights reads 64 / 32 of the bytes."""
    ql = b[..., :128].unflatten(-1, (2, 1, 64))
    low = torch.cat([ql & 0x0F, ql >> 4], dim=-2).flatten(-2)  # [..., nb, 2, 128]
    qh = b[..., 128:192].unflatten(-1, (2, 1, 32))
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=-2).flatten(-2)
    q = ((low | (high << 4)).float() - 32).unflatten(-1, (8, 16)).flatten(-3, -2)  # [..., nb, 16, 16]
    d = (_half(b, 208) * b[..., 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
    return (d * q).flatten(-2)


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block format: its name (the GGUF type name), its block's weights and bytes, its
    dequantization."""

    name: str
    block_bytes: int
    _dequantize: object  # (blocks [..., nb, block_bytes] uint8) -> float32 [..., nb, block_size]

    block_size: int = BLOCK_SIZE

    @property
    def block_name(self) -> str:
        """What the format's unit of whole weights is called: K-quants' 256 are a super-block."""
        return "super-block" if self.block_size == QK_K else "block"

    def row_bytes(self, in_features: int) -> int:
        assert in_features % self.block_size == 0, \
            f"{in_features} inputs are not whole {self.block_name}s of {self.block_size}"
        return in_features // self.block_size * self.block_bytes

    def in_features(self, row_bytes: int) -> int:
        return row_bytes // self.block_bytes * self.block_size

    def dequantize(self, blocks: torch.Tensor) -> torch.Tensor:
        """uint8 [N, row bytes] -> float32 [N, K], exactly gguf.quants.dequantize's values."""
        n = blocks.shape[0]
        return self._dequantize(blocks.reshape(n, -1, self.block_bytes)).reshape(n, -1)

    def rows(self, blocks: torch.Tensor, ids: torch.Tensor, backend: str, packed=None) -> torch.Tensor:
        """dequantize(blocks[ids]) for int64 ids [n]: float32 [n, K], the same values; from `packed`
        where pack() made one (a tied LM head's: the blocks may then be empty), on the cpu backend by
        its C++ kernel (one call, where dequantize is a handful of torch ops: an embedding lookup
        per decode step)."""
        if packed is not None:
            return _triton_packed().rows(packed, ids)
        picked = blocks.index_select(0, ids)
        if backend == "cpu" and _cpu_kernels() is not None:
            return _cpu_kernels().dequantize(picked, self.name)
        return self.dequantize(picked)

    def pack(self, blocks: torch.Tensor, backend: str):
        """The backend's own copy of these blocks for its matmul, or None where it reads them as
        stored: the triton backend repacks Q8_0 / Q4_0 / Q4_1 into 32-bit words and separate scales,
        which a GPU loads whole (kernels/triton_quant_packed.py); the blocks can then be freed."""
        if backend == "triton" and self.name in _triton_packed().FORMATS and _triton_kernels().supports(
                self.name, blocks):
            return _triton_packed().pack(blocks, self.name)
        return None

    def linear(self, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, backend: str,
               activations: str | None = None, packed=None) -> torch.Tensor:
        """x @ dequantize(blocks)^T + bias in x.dtype: through `packed` where pack() made one
        (blocks may then be empty), the cpu backend's C++ kernels (activations "int16" / "int8": x
        quantized so per block at small steps, kernels/cpu_quant.py), the triton backend's kernel
        (kernels/triton_quant.py, on CUDA or under the interpreter), else the reference
        (dequantize each call, then F.linear: correct anywhere, not fast)."""
        if packed is not None:
            return _triton_packed().packed_linear(x, packed, bias)
        if backend == "cpu" and _cpu_kernels() is not None:
            return _cpu_kernels().linear(x, blocks, self.name, bias, activations)
        if backend == "triton" and _triton_kernels().supports(self.name, x):
            return _triton_kernels().quant_linear(x, blocks, self.name, bias)
        return reference_linear(x, blocks, self, bias)


def reference_linear(x: torch.Tensor, blocks: torch.Tensor, fmt: BlockFormat,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, fmt.dequantize(blocks).to(x.dtype), bias)


FORMATS = {f.name: f for f in (
    BlockFormat("Q8_0", 34, _dequantize_q8_0),
    BlockFormat("Q4_0", 18, _dequantize_q4_0),
    BlockFormat("Q4_1", 20, _dequantize_q4_1),
    BlockFormat("Q4_K", 144, _dequantize_q4_k, QK_K),
    BlockFormat("Q6_K", 210, _dequantize_q6_k, QK_K),
)}

# A checkpoint's bfloat16 matrix held as stored on the cpu backend (kernels/cpu_quant.cpp: widened in
# registers for float32 activations, bf16 dot products for bf16 ones where the CPU has them): half
# float32's bytes, the same values. Blocks of 32 so the block kernels serve it; not a GGUF
# quantized type, so not in FORMATS (engine/loading/weights.py keep_bf16 chooses it).
BF16 = BlockFormat("BF16", 64, _widen_bf16)
# Every format a checkpoint tensor can be held in as stored, by its type name (GGUF's and safetensors'
# name for bfloat16 is BF16 too).
AS_STORED = {**FORMATS, BF16.name: BF16}

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


@functools.cache
def _triton_kernels():
    # The triton backend is resolved only where triton imports (kernels.resolve_backend).
    from kernels import triton_quant

    return triton_quant


@functools.cache
def _triton_packed():
    from kernels import triton_quant_packed

    return triton_quant_packed
