"""Decode-shaped matmuls (M = 1) on K-quant weights (Q4_K, Q6_K) against Q4_1 / Q8_0 and bf16:
ms per matmul and GB/s of weight bytes streamed, as a decode step reads them.

Each path walks distinct copies of its weight (--copies-mb of them, so the weights come from
memory, not a warm L2, as in a decode step whose layers each have their own matrices); a rep is
one pass over all copies of each path in turn (interleaved, so load from other processes falls
on every path alike); best and median per matmul over --reps. Paths:
  <format>        kernels.cpu_quant.linear on the format's blocks, bf16 activations (the engine's
                  path: linear_f32, blocks dequantized in registers)
  bf16            F.linear on a bf16 weight
  bf16_packed     kernels.cpu_ops.linear on the oneDNN-packed bf16 weight (the engine's float path)

K-quant rows are whole super-blocks of 256 inputs, so of SmolLM2-135M's projections (the default
model: hidden 576) only down_proj (576 x 1536) can be a K-quant; the 1B-class shapes are
Llama-3.2-1B's. The K-quant blocks come from tests/kernels/gguf_blocks.py (gguf.quants cannot
write them); the values do not change the speed.

Run from the repository root (it imports tests/kernels/gguf_blocks.py):
  python -m benchmarks.quant.kquant_bench [--threads 1 2] [--shapes smollm2_down ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from kernels import cpu_quant
from tests.kernels.gguf_blocks import quantize

SHAPES = {  # name -> (N out, K in)
    "smollm2_down": (576, 1536),
    "llama1b_qkv": (3072, 2048),
    "llama1b_o": (2048, 2048),
    "llama1b_gate_up": (16384, 2048),
    "llama1b_down": (2048, 8192),
}


def timed(passes: dict, reps: int) -> dict[str, list[float]]:
    """Seconds per call of each path: a rep runs one pass of every path in turn (one call per weight
    copy), so a burst of load from other processes falls on all paths alike."""
    for fns in passes.values():
        for fn in fns:
            fn()
    per_call = {name: [] for name in passes}
    for _ in range(reps):
        for name, fns in passes.items():
            t = time.perf_counter()
            for fn in fns:
                fn()
            per_call[name].append((time.perf_counter() - t) / len(fns))
    return per_call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--formats", nargs="+", default=["Q4_K", "Q6_K", "Q4_1", "Q8_0"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--copies-mb", type=float, default=64.0, help="bytes of distinct weight copies per path")
    ap.add_argument("--out")
    args = ap.parse_args()
    try:
        from kernels import cpu_ops
        cpu_ops.pack_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
    except Exception as e:  # the float kernels are another room's; their bench is optional here
        print(f"bf16_packed skipped: {e}")
        cpu_ops = None
    rows = []
    for shape in args.shapes:
        n, k = SHAPES[shape]
        w = np.random.default_rng(0).standard_normal((n, k), dtype=np.float32)
        x = torch.randn(1, k).bfloat16()
        weights = {fmt: torch.from_numpy(np.ascontiguousarray(quantize(w, fmt))) for fmt in args.formats}
        weights["bf16"] = torch.from_numpy(w).bfloat16()
        paths = {fmt: (weights[fmt], lambda b, f=fmt: cpu_quant.linear(x, b, f)) for fmt in args.formats}
        paths["bf16"] = (weights["bf16"], lambda b: F.linear(x, b))
        if cpu_ops is not None:
            packed = cpu_ops.pack_linear_weight(weights["bf16"])
            if packed is not None:
                paths["bf16_packed"] = (packed, lambda p: cpu_ops.linear(x, p, None))
        copies = {}
        for name, (weight, fn) in paths.items():
            nbytes = weight.numel() * weight.element_size()
            copies[name] = [weight.clone() for _ in range(max(1, round(args.copies_mb * 2**20 / nbytes)))]
        for threads in args.threads:
            torch.set_num_threads(threads)
            times = timed({name: [lambda c=c, fn=paths[name][1]: fn(c) for c in cs] for name, cs in copies.items()},
                          args.reps)
            for name, ts in times.items():
                nbytes = copies[name][0].numel() * copies[name][0].element_size()
                best, median = min(ts), statistics.median(ts)
                row = {"shape": shape, "N": n, "K": k, "path": name, "threads": threads, "copies": len(copies[name]),
                       "weight_MB": nbytes / 1e6, "best_ms": 1e3 * best, "median_ms": 1e3 * median,
                       "best_GBps": nbytes / best / 1e9, "median_GBps": nbytes / median / 1e9,
                       "loadavg": os.getloadavg()[0]}
                rows.append(row)
                print(json.dumps(row), flush=True)
        del copies
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads_available": os.cpu_count(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
