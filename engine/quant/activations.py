"""Integer activations for block-format matmuls on the cpu backend (EngineConfig.cpu_gguf_activations).

At a decode step's first few rows (kernels/cpu_quant.py ACTIVATION_ROWS) that module can quantize a
matmul's activations per 32-block and use integer dot products instead of widening every weight
block to float: int16 (near-exact, the default for a .gguf file) or int8 (llama.cpp's scheme,
coarser). Each matmul module that holds blocks carries the kind it takes (`activations`, None for
float); the modules and the fused C++ layers (engine/models/cpu_fused_layers.py) read it, so both
call the same kernel.
"""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)


def mark(model: nn.Module, kind: str) -> None:
    """Set `activations = kind` on each block-format matmul of `model` whose format gains from it on
    this build and CPU (kernels/cpu_quant.takes_activations), and log what was chosen and what stays
    float."""
    from kernels import cpu_build, cpu_quant

    if cpu_build.available() is not None:
        return  # no C++ kernels: the reference multiplies every format in float
    from engine.quant import BF16

    # bf16 matrices held as stored are float weights: they keep float activations.
    matmuls = [m for m in model.modules()
               if hasattr(m, "activations") and m.quant_format is not None and m.quant_format is not BF16]
    formats = {m.quant_format.name for m in matmuls}
    taken = sorted(f for f in formats if cpu_quant.takes_activations(f, kind))
    for m in matmuls:
        if m.quant_format.name in taken:
            m.activations = kind
    left = sorted(formats - set(taken))
    if taken:
        logger.info("%s activations for the %s matmuls of steps up to %d tokens (cpu_gguf_activations)%s",
                    kind, "/".join(taken), cpu_quant.ACTIVATION_ROWS[kind],
                    f"; float for {'/'.join(left)}" if left else "")
    elif left:
        logger.info("float activations for the %s matmuls: no %s kernel for them on this build "
                    "(cpu_gguf_activations)", "/".join(left), kind)
