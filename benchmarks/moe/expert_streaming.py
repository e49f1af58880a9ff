"""How fast the cpu fused MoE op streams expert weights out of cache: 12 layers' packed bf16
experts (mixtral-tiny's shape: 8 experts of 768 x 1,024, top-2), each layer called in turn so no
layer's weights are still cached, at decode-like token counts.

    python benchmarks/moe/expert_streaming.py
"""

import time

import torch

import kernels
from kernels import reference

EXPERTS, HIDDEN, FFN, TOP_K, LAYERS = 8, 768, 1024, 2, 12

torch.manual_seed(0)
layers = [kernels.pack_moe_weights((torch.randn(EXPERTS, 2 * FFN, HIDDEN) * 0.02).bfloat16(),
                                   (torch.randn(EXPERTS, HIDDEN, FFN) * 0.02).bfloat16(), backend="cpu")
          for _ in range(LAYERS)]
empty = torch.empty(0, dtype=torch.bfloat16)
for tokens in (1, 8, 64, 256):
    x = torch.randn(tokens, HIDDEN).bfloat16()
    weights, ids = reference.select_experts(torch.randn(tokens, EXPERTS), TOP_K, True)

    def run():
        for packed in layers:
            kernels.fused_moe(x, weights, ids, empty, empty, 0, packed, backend="cpu")

    run()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    active_bytes = len(torch.unique(ids)) * 3 * HIDDEN * FFN * 2
    print(f"{tokens:4d} tokens: {best / LAYERS * 1e3:.2f} ms per layer, "
          f"{active_bytes / (best / LAYERS) / 1e9:.1f} GB/s of active expert weights")
