"""bf16 rows against a bf16 weight on a CPU with native bf16 matmuls, by rows, the default model's
layer shapes and its 49,152-row LM head, weights cold (copies cycled past the last-level cache, as a
decode step streams its layers): oneDNN on its packed copy (kernels.cpu_ops.pack_linear_weight: what
--no-cpu-bf16-weights runs), F.linear on the matrix as stored, and the matrix as BF16 blocks through
the engine's path (kernels.cpu_quant.linear: bf16 dot
products at the register kernel's rows, then a layer's matrix linear_bf16_outer up to BF16_OUTER_ROWS,
F.linear on the matrix as stored beyond) and through the dot kernel itself at every row count
(linear_f32). ms a call, mean of a timed loop; ratios are packed / path.

    python benchmarks/quant/bf16_rows.py [--rows 1,2,3,4,8,16,32,64] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kernels import cpu_build, cpu_ops, cpu_quant

SHAPES = [(3072, 576), (960, 576), (576, 576), (576, 1536), (49152, 576)]
COLD_BYTES = 96 << 20  # three times this machine's 32 MB L3


def mean_ms(fn, copies: int, rows: int) -> float:
    calls = max(3, min(200, 2000 // rows))
    for i in range(3):
        fn(i % copies)
    start = time.perf_counter()
    for i in range(calls):
        fn(i % copies)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,3,4,8,16,32,64")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    quant = cpu_build.load_quant()
    print(f"native bf16 matmul {cpu_quant.native_bf16_matmul()}, bf16 dots {quant.has_bf16_dots()}, "
          f"bf16 brgemm {cpu_quant.has_brgemm_bf16()}, {args.threads} threads")
    kernel_id = cpu_quant.FORMATS["BF16"].id
    for n, k in SHAPES:
        copies = max(1, COLD_BYTES // (n * k * 2))
        weights = [torch.randn(n, k).mul(0.05).bfloat16() for _ in range(copies)]
        packed = [cpu_ops.pack_linear_weight(w) for w in weights]
        blocks = [w.view(torch.uint8) for w in weights]
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            t = {
                "packed": mean_ms(lambda i: cpu_ops.linear(x, packed[i], None), copies, m),
                "as stored": mean_ms(lambda i: F.linear(x, weights[i]), copies, m),
                "engine": mean_ms(lambda i: cpu_quant.linear(x, blocks[i], "BF16"), copies, m),
                "dots": mean_ms(lambda i: quant.linear_f32(x, blocks[i], kernel_id), copies, m),
            }
            print(f"{n} x {k}, {m:2d} rows: packed {t['packed']:.3f} ms; " + "; ".join(
                f"{name} {ms:.3f} ({t['packed'] / ms:.2f}x)" for name, ms in t.items() if name != "packed"), flush=True)


if __name__ == "__main__":
    main()
