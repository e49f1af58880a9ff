"""One-row weight-only matmuls on a GPU: the GEMV kernel against the tl.dot kernel it replaces at
one row, and against cuBLAS on the bf16 weight (a probe for one lease).

    python benchmarks/gpu/gemv_bench.py

Shapes: a Llama-3.2-1B layer's four matmuls. Bandwidth = the bytes of the weight as stored (Q4_1:
5 bits a weight, Q8_0: 8.5, bf16: 16) / median time (triton.testing.do_bench, L2 flushed).
"""

from __future__ import annotations

import torch
import triton.testing

from engine.quant.quantize import quantize
from kernels import triton_quant

SHAPES = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))
# (GEMV_BLOCK_N, GEMV_GROUPS, GEMV_WARPS) tried on int4 after the table; the first is the default
SWEEP = ((16, 8, 4), (32, 4, 4), (8, 16, 4), (16, 4, 2), (32, 8, 8), (16, 16, 4), (64, 4, 8), (32, 8, 4))


def main() -> int:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")

    for n, k in SHAPES:
        w = torch.randn(n, k, device=dev, generator=gen, dtype=torch.float32) / k**0.5
        x = torch.randn(1, k, device=dev, generator=gen).to(torch.bfloat16)
        wb = w.to(torch.bfloat16)
        ms = bench(lambda: torch.nn.functional.linear(x, wb))
        line = [f"{n}x{k}: cuBLAS bf16 {ms * 1e3:6.1f} us {n * k * 2 / ms / 1e6:5.0f} GB/s"]
        for method in ("int4", "int8"):
            q = quantize(w, method, 128)
            blocks, fmt = q.blocks, q.format.name
            nbytes = blocks.numel()
            got = triton_quant.quant_linear(x, blocks, fmt)
            saved = triton_quant.GEMV_FORMATS
            triton_quant.GEMV_FORMATS = {}  # the tl.dot kernel at one row, as before the GEMV
            try:
                want = triton_quant.quant_linear(x, blocks, fmt)
                dot_ms = bench(lambda: triton_quant.quant_linear(x, blocks, fmt))
            finally:
                triton_quant.GEMV_FORMATS = saved
            err = (got.float() - want.float()).abs().max().item()
            gemv_ms = bench(lambda: triton_quant.quant_linear(x, blocks, fmt))
            line.append(f"{method} GEMV {gemv_ms * 1e3:6.1f} us {nbytes / gemv_ms / 1e6:5.0f} GB/s"
                        f" (dot {dot_ms * 1e3:6.1f} us; {dot_ms / gemv_ms:.2f}x; max diff {err:.2g})")
        print("; ".join(line), flush=True)
    default = (triton_quant.GEMV_BLOCK_N, triton_quant.GEMV_GROUPS, triton_quant.GEMV_WARPS)
    for n, k in SHAPES:
        w = torch.randn(n, k, device=dev, generator=gen, dtype=torch.float32) / k**0.5
        x = torch.randn(1, k, device=dev, generator=gen).to(torch.bfloat16)
        q = quantize(w, "int4", 128)
        line = []
        for cfg in SWEEP:
            triton_quant.GEMV_BLOCK_N, triton_quant.GEMV_GROUPS, triton_quant.GEMV_WARPS = cfg
            try:
                ms = bench(lambda: triton_quant.quant_linear(x, q.blocks, "Q4_1"))
                line.append(f"{cfg}: {q.blocks.numel() / ms / 1e6:.0f}")
            except Exception as e:  # a tile that does not compile: say so, go on
                line.append(f"{cfg}: {type(e).__name__}")
        triton_quant.GEMV_BLOCK_N, triton_quant.GEMV_GROUPS, triton_quant.GEMV_WARPS = default
        print(f"int4 GEMV sweep {n}x{k} (GB/s): " + ", ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
