"""A few launches of the one-row packed matmul on one shape, for Nsight Compute to profile
(benchmarks/gpu/ncu_gemv.sh): no timing here, ncu measures one launch after the warm-up.

    python benchmarks/gpu/gemv_once.py [--shape 16384x2048] [--format Q4_1] [--launches 4]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="16384x2048", help="N x K of the weight (default: a 1B model's gate_up)")
    p.add_argument("--format", default="Q4_1", choices=["Q4_0", "Q4_1", "Q8_0"])
    p.add_argument("--launches", type=int, default=4)
    args = p.parse_args()
    from engine.quant.quantize import quantize_int4, quantize_int8
    from kernels import triton_quant_packed as tqp

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a rehearsal under TRITON_INTERPRET=1
    n, k = map(int, args.shape.split("x"))
    w = torch.randn(n, k) / k ** 0.5
    blocks = (quantize_int8(w) if args.format == "Q8_0" else quantize_int4(w, 32)).blocks
    packed = tqp.pack(blocks.to(dev), "Q8_0" if args.format == "Q8_0" else "Q4_1")
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    for _ in range(args.launches):
        tqp.packed_linear(x, packed)
    if dev == "cuda":
        torch.cuda.synchronize()
    plan = tqp.launch_plan(1, n, k, packed.format, torch.cuda.get_device_properties(0).multi_processor_count
                           if dev == "cuda" else 1)
    print(f"{args.format} {n}x{k}: {plan}")


if __name__ == "__main__":
    main()
