"""Quantized matmuls past the register kernel (17+ activation rows) on a CPU where oneDNN's GEMM now
takes them (kernels/cpu_quant._sliced_gemm): per layer shape of the default model (Q4_1) and its LM
head (Q8_0), milliseconds a call, the old path against the new one in the same process.
  --dtype bfloat16: AVX512_BF16 without bf16 brgemm (no AMX: Zen 4/5). Old: the rows widened to
                    float32 (the tiled kernel, MKL's sgemm); new: the weight dequantized to bf16,
                    oneDNN's bf16 GEMM.
  --dtype float32:  AVX-512 without AMX. Old: the tiled kernel up to TILED_GEMM_ROWS, then the whole
                    weight dequantized and F.linear (MKL's sgemm); new: oneDNN's float32 GEMM. Then
                    the LM head at a few slice sizes (GEMM_SLICE_BYTES).

    python benchmarks/quant/gemm_rows.py --dtype bfloat16|float32 [--threads 2] [--rows 17,32,128,2048]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


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
    p.add_argument("--dtype", choices=("bfloat16", "float32"), required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="17,32,128,2048")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    bf16 = args.dtype == "bfloat16"
    onednn_float32 = cpu_quant.onednn_float32  # the CPU's own answer, put back after each old/new pair
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, native bf16 matmul "
          f"{cpu_quant.native_bf16_matmul()}, bf16 brgemm {cpu_quant.has_brgemm_bf16()}, "
          f"oneDNN float32 {cpu_quant.onednn_float32()}")
    cases = [(3072, 576, "Q4_1"), (960, 576, "Q4_1"), (576, 576, "Q4_1"), (576, 1536, "Q4_1"), (49152, 576, "Q8_0")]
    for n, k, fmt in cases:
        w = np.random.default_rng(n).standard_normal((n, k), dtype=np.float32) * 0.05
        blocks = torch.from_numpy(quantize(w, GGMLQuantizationType[fmt]))
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k).to(getattr(torch, args.dtype))
            cpu_quant.onednn_float32 = lambda: False  # float32 as before this change: the tiled kernel, MKL
            old = timed(lambda: cpu_quant.linear(x.float(), blocks, fmt).bfloat16() if bf16
                        else cpu_quant.linear(x, blocks, fmt))
            cpu_quant.onednn_float32 = lambda: True
            new = timed(lambda: cpu_quant.linear(x, blocks, fmt))
            cpu_quant.onednn_float32 = onednn_float32
            print(f"{fmt} {n} x {k}, {m} rows: old {old:.2f} ms, new {new:.2f} ms ({old / new:.2f}x)", flush=True)
        if n == 49152 and not bf16:
            x = torch.randn(32, k)
            default = cpu_quant.GEMM_SLICE_BYTES
            for size in (2 << 20, 4 << 20, 8 << 20, 16 << 20):
                cpu_quant.GEMM_SLICE_BYTES = size
                ms = timed(lambda: cpu_quant.linear(x, blocks, fmt))
                print(f"  LM head, 32 rows, slices of {size >> 20} MB: {ms:.2f} ms")
            cpu_quant.GEMM_SLICE_BYTES = default


if __name__ == "__main__":
    main()
