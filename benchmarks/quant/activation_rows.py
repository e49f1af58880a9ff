"""Where integer activations stop paying: the block matmuls at few rows, each integer kernel
(linear_q16 / linear_q8) against the float register kernel (linear_f32), over 30 layers of the
default model's Q4_1 shapes (random weights, so each call reads its weight from memory as a decode
step does), alternating the kernels, median of --runs. cpu_quant.ACTIVATION_ROWS comes from this.

    python benchmarks/quant/activation_rows.py [--rows 1,2,3,4,6,8] [--runs 9]
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch

from kernels import cpu_quant

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,3,4,6,8")
    p.add_argument("--runs", type=int, default=9)
    args = p.parse_args()
    q, fmt = cpu_quant.load_quant(), cpu_quant.FORMATS["Q4_1"].id
    weights = {k: [torch.from_numpy(gguf.quants.quantize(np.random.randn(*s).astype(np.float32),
                                                         gguf.GGMLQuantizationType.Q4_1)) for _ in range(LAYERS)]
               for k, s in SHAPES.items()}

    def step_ms(kernel, m: int) -> float:
        xs = {k: torch.randn(m, s[1]) for k, s in SHAPES.items()}
        start = time.perf_counter()
        for k in SHAPES:
            for w in weights[k]:
                kernel(xs[k], w, fmt)
        return (time.perf_counter() - start) * 1e3

    kernels = {"float": q.linear_f32, "int16": q.linear_q16 if q.has_int16_dots() else None, "int8": q.linear_q8}
    kernels = {k: v for k, v in kernels.items() if v is not None}
    for m in (int(r) for r in args.rows.split(",")):
        times = {k: [] for k in kernels}
        for _ in range(args.runs):
            for k, kernel in kernels.items():
                times[k].append(step_ms(kernel, m))
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        print(f"{m:2d} rows: " + "  ".join(f"{k} {v:6.2f} ms" for k, v in med.items()) + "  " +
              "  ".join(f"{k}/float {med[k] / med['float']:.3f}" for k in med if k != "float"), flush=True)


if __name__ == "__main__":
    main()
