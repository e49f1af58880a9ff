"""One decode step's matmuls with cold caches: SmolLM2-135M's 30 layers of projections (each its own
weights, so nothing stays in cache between layers, as in a real step) plus the tied LM head, M=1,
through each path. python benchmarks/quant/decode_sweep.py [--reps 30]"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from kernels import cpu_ops, cpu_quant

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--format", default="Q4_1")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    mats = [rng.standard_normal(s, dtype=np.float32) for _ in range(args.layers) for s in LAYER]
    blocks = [torch.from_numpy(quantize(m, GGMLQuantizationType[args.format]).copy()) for m in mats]
    packed = [cpu_ops.pack_linear_weight(torch.from_numpy(m).bfloat16()) for m in mats]
    xs = {k: torch.randn(1, k).bfloat16() for k in (576, 1536)}
    paths = {
        "native_f32_regs": lambda: [cpu_quant.linear(xs[cpu_quant.in_features(b, args.format)], b, args.format)
                                    for b in blocks],
        "native_q8_vnni": lambda: [cpu_quant.linear_q8(xs[cpu_quant.in_features(b, args.format)], b, args.format)
                                   for b in blocks],
        "bf16_onednn_packed": lambda: [cpu_ops.linear(xs[m.shape[1]], p, None) for m, p in zip(mats, packed)],
    }
    times = {name: [] for name in paths}
    for _ in range(args.reps):
        for name, fn in paths.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    out = {"format": args.format, "layers": args.layers, "threads": torch.get_num_threads(),
           "loadavg": os.getloadavg(),
           "bytes": {"native": sum(b.numel() for b in blocks), "bf16": sum(m.size * 2 for m in mats)}}
    for name, ts in times.items():
        ts.sort()
        out[name] = {"best_ms": 1e3 * ts[0], "median_ms": 1e3 * ts[len(ts) // 2]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
