"""bf16 activations against a bf16 weight on the CPU, by rows: torch's bf16 GEMM (F.linear), the
weight as BF16 blocks through cpu_quant.linear (bf16 rows; on a CPU without bf16 brgemm they are
widened and take the float32 kernels), and float32 F.linear on the widened weight; min of --runs.
On a CPU without native bf16 matmuls (AVX2) the first is the slow one.

    python benchmarks/quant/bf16_matmul_rows.py [--runs 5]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kernels import cpu_quant


def best_ms(fn, runs: int) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    for n, k in ((2048, 768), (768, 1024)):
        w = torch.randn(n, k).bfloat16()
        wf, blocks = w.float(), w.view(torch.uint8)
        for m in (1, 16, 64, 256):
            x = torch.randn(m, k).bfloat16()
            xf = x.float()
            print(f"{n} x {k}, {m:3d} rows: F.linear bf16 {best_ms(lambda: F.linear(x, w), args.runs):6.2f} ms, "
                  f"BF16 blocks {best_ms(lambda: cpu_quant.linear(x, blocks, 'BF16'), args.runs):6.2f} ms, "
                  f"F.linear float32 {best_ms(lambda: F.linear(xf, wf), args.runs):6.2f} ms", flush=True)


if __name__ == "__main__":
    main()
