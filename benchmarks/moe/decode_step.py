"""One decode step of 64 sequences (128-token random prompts) on a model folder, bfloat16: the
time of 34 generated tokens minus that of 2, over 32.

    python benchmarks/moe/decode_step.py /tmp/mixtral-tiny
"""

import random
import sys
import time

from engine import LLM, SamplingParams

llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=512)
rng = random.Random(0)
prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(64)]


def run(tokens: int) -> float:
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - start


run(2)  # warm-up; the prompts are then prefix-cached, so both timed runs skip most of the prefill
short, long = run(2), run(34)
print(f"per decode step (64 sequences): {(long - short) / 32 * 1e3:.1f} ms")
