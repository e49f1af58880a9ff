"""The default model's quantized matmuls at M activation rows, each kernel over every Q4_1 matrix of
the GGUF file once (66 MB of blocks: more than the L3 of the machines here, so the weights stream
from memory as in a decode step), best of --reps: linear_f32 (the register kernel, DEQUANT_GEMM_ROWS
rows and under) against linear_f32_tiled (the float tiles; their GEMM is sgemm, or on an AVX2 build
the 6 x 16 micro-kernel). Where the two cross is what kernels/cpu_quant.py's row thresholds encode.

python benchmarks/quant/rows_sweep.py [--threads 2] [--rows 1,2,4,8,12,16,24,32]
"""

from __future__ import annotations

import argparse
import time

import gguf
import torch

from engine.loading.default_model import default_gguf_path
from kernels import cpu_quant


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4,8,12,16,24,32")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    reader = gguf.GGUFReader(default_gguf_path())
    mats = [torch.from_numpy(t.data.copy()).reshape(int(t.shape[1]), -1) for t in reader.tensors
            if t.name.startswith("blk.") and t.tensor_type.name == "Q4_1"]
    kid = cpu_quant.FORMATS["Q4_1"].id
    ops = cpu_quant.load_quant()
    weights = sum(w.shape[0] * cpu_quant.in_features(w, "Q4_1") for w in mats)
    print(f"{len(mats)} Q4_1 matrices, {sum(w.numel() for w in mats) / 1e6:.1f} MB, {args.threads} threads")
    for m in (int(v) for v in args.rows.split(",")):
        xs = {k: torch.randn(m, k) for k in {cpu_quant.in_features(w, "Q4_1") for w in mats}}
        best = {}
        for name, fn in (("register", ops.linear_f32), ("tiled", ops.linear_f32_tiled)):
            times = []
            for _ in range(args.reps):
                t = time.perf_counter()
                for w in mats:
                    fn(xs[cpu_quant.in_features(w, "Q4_1")], w, kid)
                times.append(time.perf_counter() - t)
            best[name] = min(times)
        gflops = {k: 2 * weights * m / v / 1e9 for k, v in best.items()}
        print(f"M={m:4d}  register {best['register'] * 1e3:7.1f} ms ({gflops['register']:5.1f} GFLOP/s)  "
              f"tiled {best['tiled'] * 1e3:7.1f} ms ({gflops['tiled']:5.1f} GFLOP/s)  "
              f"register/tiled {best['register'] / best['tiled']:.2f}", flush=True)


if __name__ == "__main__":
    main()
