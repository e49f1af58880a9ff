"""QuantizedTensor: a checkpoint tensor handed over as stored (GGUF blocks), for a layer that keeps
it quantized. Its narrow() takes rows, or columns in whole blocks (K-quants: super-blocks of 256),
so a layer's weight_loader slices its tensor-parallel shard the same way for a float tensor and a
quantized one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.quant.formats import BlockFormat


@dataclass
class QuantizedTensor:
    blocks: torch.Tensor  # uint8 [rows, in_features / block_size * block_bytes]
    format: BlockFormat

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.format.in_features(self.blocks.shape[1])

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        if dim == 0:
            return QuantizedTensor(self.blocks.narrow(0, start, length), self.format)
        assert dim == 1, "a quantized weight is 2-D"
        bs = self.format.block_size
        if start % bs or length % bs:
            raise ValueError(f"a {self.format.name} weight splits only on whole {self.format.block_name}s of {bs} "
                             f"inputs; columns {start}..{start + length} are not (use a tensor-parallel size "
                             f"that divides in_features / {bs}, or load the GGUF dequantized)")
        bb = self.format.block_bytes
        return QuantizedTensor(self.blocks.narrow(1, start // bs * bb, length // bs * bb), self.format)

    def dequantize(self) -> torch.Tensor:
        return self.format.dequantize(self.blocks)
