"""A batch's prefill and decode apart, offline: N random prompts of --prompt-len tokens on the default
model (or --model), prefix caching off, greedy, EOS ignored; one call with max_tokens 1 (the
prefill), one with 1 + --new-tokens (both), the decode = their difference, per round.

    python benchmarks/quant/prefill_decode_split.py [--dtype float32] [--num-prompts 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    from engine import LLM, SamplingParams
    from engine.loading.default_model import default_gguf_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model's Q4_1 file")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args()
    llm = LLM(model=args.model or default_gguf_path(), dtype=args.dtype, num_threads=args.num_threads,
              enable_prefix_caching=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]

    def run(new_tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0), use_tqdm=False)
        return time.perf_counter() - start

    run(4)  # warm-up
    n = args.num_prompts
    for _ in range(args.rounds):
        prefill, both = run(1), run(1 + args.new_tokens)
        decode = both - prefill
        print(f"prefill {n} x {args.prompt_len}: {prefill:.2f} s ({n * args.prompt_len / prefill:.0f} tok/s); "
              f"{n} x {args.prompt_len}/{args.new_tokens}: {both:.2f} s; decode {decode:.2f} s "
              f"({decode / args.new_tokens * 1e3:.0f} ms a step at {n} rows)", flush=True)


if __name__ == "__main__":
    main()
