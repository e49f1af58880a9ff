"""Batch-8 decode of the default model with its tied LM head as the file stores it (Q8_0 blocks) or
dequantized to bf16 (the loader told to leave the vocabulary matrix float), everything else equal:
what the quantized head costs at 8 sequences (BENCHMARKS.md, "Decode against llama.cpp"). Run the two alternately:

    python benchmarks/llamacpp/lm_head_batch8.py quanthead
    python benchmarks/llamacpp/lm_head_batch8.py floathead
"""

from __future__ import annotations

import random
import sys
import time

import engine.loading.weights as weights
from engine import LLM
from engine.loading.default_model import default_gguf_path
from engine.sampling_params import SamplingParams


def main(head: str) -> None:
    if head == "floathead":
        holder = weights._block_holder
        weights._block_holder = lambda modules, target, vocabulary=False: holder(modules, target, False)
    llm = LLM(model=default_gguf_path(), dtype="bfloat16", device="cpu")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(8)]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    print(f"{head}: {8 * 128 / best:.1f} output tok/s (best of 3)")
    llm.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
