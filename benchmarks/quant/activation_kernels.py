"""The register kernel (float activations, linear_f32) against the integer-activation kernels
(linear_q16, linear_q8) at one activation row, 2 threads:

  warm   one 49152 x 576 matrix per format (an LM head's shape; Q4_1 17.7 MB, which stays in this
         machine's 32 MB L3 between calls), best of 20 calls;
  cold   the default model's 120 layer matrices (Q4_1, 66 MB) one after the other as a decode step
         meets them, median of 5 passes;
  error  each kernel's largest error against the float64 product, relative to its largest value.

python benchmarks/quant/activation_kernels.py --out benchmarks/quant/s11/activation-kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kernels import cpu_build, cpu_quant

# The C++ entry points themselves (the Python wrappers cost ~10 us a call, a tenth of a small matmul).
KERNELS = {"f32": "linear_f32", "int16": "linear_q16", "int8": "linear_q8"}


def kernel(name: str):
    fn = getattr(cpu_build.load_quant(), KERNELS[name])
    return lambda x, blocks, fmt: fn(x, blocks, cpu_quant.FORMATS[fmt].id)


def warm(fmt: str) -> dict:
    w = np.random.default_rng(0).standard_normal((49152, 576), dtype=np.float32)
    raw = quantize(w, GGMLQuantizationType[fmt])
    blocks = torch.from_numpy(raw.copy())
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(0))
    exact = x.double() @ torch.from_numpy(dequantize(raw, GGMLQuantizationType[fmt])).double().T
    row = {}
    for name in KERNELS:
        fn = kernel(name)
        times = []
        for _ in range(20):
            start = time.perf_counter()
            y = fn(x, blocks, fmt)
            times.append(time.perf_counter() - start)
        row[name] = {"best_ms": 1e3 * min(times), "GB_s": blocks.numel() / min(times) / 1e9,
                     "max_rel_error": ((y.double() - exact).abs().max() / exact.abs().max()).item()}
    return row


def cold() -> dict:
    from engine import LLM

    llm = LLM(None, max_model_len=256, num_threads=torch.get_num_threads())
    weights = [m.weight for layer in llm.engine.runner.model.model.layers.values()
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    fmt = llm.engine.runner.model.model.layers["0"].mlp.down_proj.quant_format.name
    inputs = [torch.randn(1, cpu_quant.in_features(w, fmt)) for w in weights]
    times: dict[str, list[float]] = {name: [] for name in KERNELS}
    for _ in range(5):
        for name in KERNELS:
            fn = kernel(name)
            start = time.perf_counter()
            for w, x in zip(weights, inputs):
                fn(x, w, fmt)
            times[name].append(time.perf_counter() - start)
    llm.shutdown()
    nbytes = sum(w.numel() for w in weights)
    return {"format": fmt, "matrices": len(weights), "MB": nbytes / 1e6,
            **{name: {"median_ms": 1e3 * statistics.median(t), "GB_s": nbytes / statistics.median(t) / 1e9}
               for name, t in times.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    assert torch.get_num_threads() == args.threads
    result = {"threads": args.threads, "load_average_start": os.getloadavg(),
              "warm": {fmt: warm(fmt) for fmt in ("Q4_1", "Q4_0", "Q8_0")}, "cold": cold(),
              "load_average_end": os.getloadavg()}
    for fmt, row in result["warm"].items():
        print(fmt, "warm", {k: f"{v['best_ms']:.2f} ms, err {v['max_rel_error']:.1e}" for k, v in row.items()})
    print("cold", {k: f"{v['median_ms']:.2f} ms" for k, v in result["cold"].items() if isinstance(v, dict)})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
