"""This CPU as a serving device, measured at start: memory bandwidth and matmul FLOP/s.

The one module of engine/planning that imports torch, lazily, for `engine plan serve --slo --gpu cpu`.
"""

from __future__ import annotations

import time

from engine.planning.slo import Device


def _rate(work: float, run, seconds: float) -> float:
    run()  # warm up: first-touch page faults, oneDNN's kernel selection
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or n < 3:
        run()
        n += 1
    return work * n / elapsed


def measure_cpu(dtype: str = "bfloat16", seconds: float = 0.5, threads: int | None = None, *,
                hidden: int = 2048, ffn: int = 2048) -> Device:
    """Memory bandwidth: bytes copied per second, a 512 MiB buffer (past this machine's 480 MiB L3) copied
    into another. A decode step's matmuls stream each weight through the cores at about that rate here:
    the default model's decode at batch 1 reads its 269 MB of bf16 weights at 12.3 GB/s, the copy runs at
    12.7-13.2 GB/s, while a read-only sum reaches 23-27 GB/s, which no matmul kernel here does.
    FLOP/s: a [512, hidden] x [hidden, ffn] matmul in the serving dtype (2mnk FLOPs), a prefill chunk
    through the model's own MLP shape. Efficiency 1.0: these are the rates its operations reach here."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    src = torch.ones(128 << 20, dtype=torch.float32)
    dst = torch.empty_like(src)
    bandwidth = _rate(src.nbytes, lambda: dst.copy_(src), seconds)
    kind = getattr(torch, dtype)
    a, b = torch.randn(512, hidden).to(kind), torch.randn(hidden, ffn).to(kind)
    flops = _rate(2 * 512 * hidden * ffn, lambda: a @ b, seconds)
    return Device(name=f"this CPU ({torch.get_num_threads()} threads, {dtype})", memory_bytes=None, flops=flops,
                  memory_bw=bandwidth, efficiency=1.0)
