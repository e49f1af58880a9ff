"""Where to pad a step's rows: per matmul (a copy each call) or once at the model input (the
matmul then simply runs on the padded count). One packed bf16 576 -> 1536 weight; best of 5 x 30
calls at each row count, as ratios to the unpadded matmul.

    python benchmarks/soak/padding_cost.py
"""

import time

import torch

from kernels.cpu_ops import padded_num_tokens

packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(1536, 576, dtype=torch.bfloat16), 64)


def linear(x):
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def pad_then_linear(x):
    m = x.shape[0]
    return linear(torch.nn.functional.pad(x, (0, 0, 0, padded_num_tokens(m) - m)))[:m]


def best(fn, x, reps=30):
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn(x)
        times.append((time.perf_counter() - start) / reps)
    return min(times)


for m in [17, 33, 100, 257, 700, 1100, 2049]:
    x, xp = torch.randn(m, 576, dtype=torch.bfloat16), torch.randn(padded_num_tokens(m), 576, dtype=torch.bfloat16)
    for fn, arg in ((linear, x), (pad_then_linear, x), (linear, xp)):
        fn(arg)
    plain = best(linear, x)
    print(f"rows {m:5d} -> {padded_num_tokens(m):5d}: pad per matmul {best(pad_then_linear, x) / plain:.3f}x, "
          f"matmul on the padded rows {best(linear, xp) / plain:.3f}x")
