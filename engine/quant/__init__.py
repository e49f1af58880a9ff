"""Weight formats: how a weight is stored and the matmul that consumes it.

Today: GGUF's block formats Q8_0, Q4_0 and Q4_1 (formats.py), kept as the file stores them and
multiplied by the cpu backend's C++ kernels (kernels/cpu_quant.cpp), the triton backend's kernel
(kernels/triton_quant.py) or, on the torch backend, by dequantize-then-F.linear. A linear layer
holds such a weight as a uint8 parameter plus its format (engine/layers/linear.py,
quantize_weight); the GGUF loader hands it QuantizedTensor shards. Other sources are converted
into the same blocks at load, so the same kernels serve them: float weights by `--quantization
int8 | int4` (quantize.py), and pre-quantized GPTQ / AWQ / compressed-tensors checkpoints
(prequantized.py). fp8 (e4m3) weights have a block layout of their own, F8_E4M3 (fp8.py), which
the triton and torch backends read.
"""

from engine.quant.formats import AS_STORED, BF16, BLOCK_SIZE, FLOAT_TYPES, FORMATS, BlockFormat, reference_linear
from engine.quant.tensor import QuantizedTensor
from engine.quant.quantize import quantize
from engine.quant.prequantized import METHODS as PREQUANTIZED_METHODS, read_quantization_config

__all__ = ["AS_STORED", "BF16", "BLOCK_SIZE", "FLOAT_TYPES", "FORMATS", "PREQUANTIZED_METHODS", "BlockFormat",
           "QuantizedTensor", "quantize", "read_quantization_config", "reference_linear"]
