"""Time the quantized CPU matmul paths on SmolLM2-135M's projection shapes against the bf16/fp32
F.linear they replace. From the repository root (it imports tests/kernels/gguf_blocks.py):
python -m benchmarks.quant.kernel_bench [--rows 1 4 16 64 512] [--formats Q4_1 Q4_K]"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from kernels import cpu_quant
from tests.kernels.gguf_blocks import quantize  # gguf.quants.quantize, plus the K-quants it cannot write

SHAPES = {"gate_up": (3072, 576), "down": (576, 1536), "qkv": (960, 576), "lm_head": (49152, 576)}


def best_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 512])
    ap.add_argument("--formats", nargs="+", default=["Q4_1", "Q8_0"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    results = []
    for shape in args.shapes:
        n, k = SHAPES[shape]
        w = np.random.default_rng(0).standard_normal((n, k), dtype=np.float32)
        w_bf16 = torch.from_numpy(w).bfloat16()
        for fmt in args.formats:
            blocks = torch.from_numpy(quantize(w, fmt).copy())
            kid = cpu_quant.FORMATS[fmt].id
            for m in args.rows:
                x = torch.randn(m, k)
                xb = x.bfloat16()
                row = {"shape": shape, "N": n, "K": k, "format": fmt, "M": m, "load": os.getloadavg()[0]}
                row["f32_regs_ms"] = best_ms(lambda: cpu_quant.load_quant().linear_f32(x, blocks, kid), args.reps)
                if fmt in cpu_quant.Q8_FORMATS:
                    row["q8_vnni_ms"] = best_ms(lambda: cpu_quant.linear_q8(x, blocks, fmt), args.reps)
                row["dequant_bf16_gemm_ms"] = best_ms(
                    lambda: F.linear(xb, cpu_quant.dequantize(blocks, fmt, torch.bfloat16)), args.reps)
                row["bf16_linear_ms"] = best_ms(lambda: F.linear(xb, w_bf16), args.reps)
                results.append(row)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
