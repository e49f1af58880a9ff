"""Steps per second of a decode-like stack of bf16 matmuls (the default model's 30 layers' shapes:
qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576, ROWS rows each), on THREADS threads,
unbound or bound one to each CPU (kernels.cpu_ops.set_thread_cpus, what the thread follower does
while other processes keep every CPU busy). Start the competing load first, e.g. one busy loop per
CPU, and alternate the variants: the scheduler's placement of unbound threads holds for seconds,
so one run of each says little.

    for _ in $(seq $(nproc)); do python -c "while True: pass" & done
    for r in 1 2 3; do for v in "1 free" "2 free" "2 bound"; do
        python benchmarks/threads/bound_matmuls.py $v --rows 64; done; done
    kill $(jobs -p)
"""

from __future__ import annotations

import argparse
import os
import time

import engine  # noqa: F401  (bounds OpenMP's spin before torch loads, as the engine runs)
import torch

from kernels import cpu_ops

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer
LAYERS = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("threads", type=int)
    parser.add_argument("placement", choices=["free", "bound"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = [torch.randn(n, k, dtype=torch.bfloat16) for n, k in SHAPES] * LAYERS
    inputs = {k: torch.randn(args.rows, k, dtype=torch.bfloat16) for _, k in SHAPES}

    def step():
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    for _ in range(3):
        step()
    if args.placement == "bound":
        cpu_ops.set_thread_cpus(sorted(os.sched_getaffinity(0)), True)
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < args.seconds:
        step()
        steps += 1
    rate = steps / (time.perf_counter() - started)
    print(f"threads {args.threads} {args.placement:5s} rows {args.rows}: {rate:6.2f} steps/s  "
          f"load {open('/proc/loadavg').read().split()[0]}")


if __name__ == "__main__":
    main()
