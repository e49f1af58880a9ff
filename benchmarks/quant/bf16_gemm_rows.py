"""bf16 rows past the register kernel on a CPU with AVX512_BF16 but no bf16 brgemm (no AMX: Zen 4/5):
the rows widened to float32 (MKL's sgemm on the dequantized or tiled weight: what cpu_quant.linear did
there before) against the weight dequantized to bfloat16 whole and oneDNN's bf16 GEMM (what it does
now), per layer shape of the default model (Q4_1) and its LM head (Q8_0), milliseconds a call.

    python benchmarks/quant/bf16_gemm_rows.py [--threads 2] [--rows 32,128,2048]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F


def timed(fn, n: int = 10) -> float:
    for _ in range(2):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    from gguf import GGMLQuantizationType, quantize

    from kernels import cpu_quant

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="32,128,2048")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"native bf16 matmul {cpu_quant.native_bf16_matmul()}, bf16 brgemm {cpu_quant.has_brgemm_bf16()}")
    for n, k in ((3072, 576), (960, 576), (576, 576), (576, 1536), (49152, 576)):
        fmt = "Q8_0" if n == 49152 else "Q4_1"
        w = np.random.default_rng(n).standard_normal((n, k), dtype=np.float32) * 0.05
        blocks = torch.from_numpy(quantize(w, GGMLQuantizationType[fmt]))
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            widened = timed(lambda: cpu_quant.linear(x.float(), blocks, fmt).bfloat16())
            gemm = timed(lambda: F.linear(x, cpu_quant.dequantize(blocks, fmt, torch.bfloat16)))
            now = timed(lambda: cpu_quant.linear(x, blocks, fmt))
            print(f"{fmt} {n} x {k}, {m} rows: widened to float32 {widened:.2f} ms, bf16 dequantize + GEMM "
                  f"{gemm:.2f} ms ({widened / gemm:.2f}x); now linear {now:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
