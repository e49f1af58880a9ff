"""The default model's quantized matmuls (Q4_1 weights of its layer shapes and its 49,152-row head, bf16
activations) three ways: torch's team of every CPU; one torch thread plus a helper for every other
CPU in kernels/cpu_quant.cpp's pool (cpu_build.set_helpers, what the load follower runs on CPUs
that other processes keep busy); one thread. At 1 row (decode at batch 1: the register kernel) and
64 rows (batched decode: dequantize + oneDNN's GEMM, per slice with helpers). Quiet machine; us per call.

    python benchmarks/threads/pool_matmuls.py
"""

from __future__ import annotations

import os
import time

import torch

from kernels import cpu_build, cpu_quant
from tests.kernels.test_quant_kernels import _weight

SHAPES = [(960, 576), (1536 * 2, 576), (576, 1536), (49152, 576)]  # qkv, gate_up, down, the head


def _time(f, calls: int) -> float:
    for _ in range(max(3, calls // 20)):
        f()
    start = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    cpus = len(os.sched_getaffinity(0))
    print(f"load {open('/proc/loadavg').read().split()[0]}, {cpus} CPUs; us per call")
    for n, k in SHAPES:
        blocks, _ = _weight("Q4_1", n, k, seed=n)
        for rows in (1, 64):
            x = torch.randn(rows, k).to(torch.bfloat16)
            calls = 30 if n * rows > 10**6 else 500
            times = {}
            for mode, threads, helpers in (("team", cpus, 0), ("1 + helpers", 1, cpus - 1), ("one", 1, 0)):
                torch.set_num_threads(threads)
                cpu_build.set_helpers(helpers)
                times[mode] = _time(lambda: cpu_quant.linear(x, blocks, "Q4_1"), calls)
            cpu_build.set_helpers(0)
            torch.set_num_threads(cpus)
            print(f"{n:6d} x {k:4d}, {rows:2d} rows: " + "  ".join(f"{m} {t:8.1f}" for m, t in times.items())
                  + f"  (1 + helpers) / team {times['1 + helpers'] / times['team']:.2f}")


if __name__ == "__main__":
    main()
