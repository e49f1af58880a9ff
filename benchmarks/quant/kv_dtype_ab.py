"""Batch-1 decode with a float32 KV cache (`--kv-cache-dtype auto` on CPU) against a 16-bit one, two
engines in one process, alternating rounds (this machine's speed moves too much between processes
to rank a few percent); prints each round's tok/s (decode steps' median) and how many tokens agree.

    python benchmarks/quant/kv_dtype_ab.py [--rounds 8] [--prompt-len 128] [--kv bfloat16] [--model FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    from engine import LLM, SamplingParams
    from engine.loading.default_model import default_gguf_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--kv", default="bfloat16", help="the 16-bit cache: bfloat16 or float16")
    p.add_argument("--model", default=None, help="default: the default model's Q4_1 file")
    args = p.parse_args()
    kinds = ("auto", args.kv)
    llms = {k: LLM(model=args.model or default_gguf_path(), num_threads=2, kv_cache_dtype=k,
                   kv_cache_memory="512MiB") for k in kinds}
    steps: dict[str, list[float]] = {k: [] for k in kinds}
    for kind, llm in llms.items():
        def timed(*a, _step=llm.engine.step, _out=steps[kind], **k):
            start = time.perf_counter()
            out = _step(*a, **k)
            _out.append(time.perf_counter() - start)
            return out
        llm.engine.step = timed
    prompt = list(range(100, 100 + args.prompt_len))
    params = SamplingParams(max_tokens=args.new_tokens + 1, temperature=0, ignore_eos=True)
    tok_s: dict[str, list[float]] = {k: [] for k in kinds}
    tokens = {}
    for r in range(args.rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            steps[kind].clear()
            tokens[kind] = llms[kind].generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            tok_s[kind].append(1 / statistics.median(steps[kind][1:]))  # decode steps (the first prefills)
        print(f"round {r}: float32 cache {tok_s['auto'][-1]:.1f}, {args.kv} cache {tok_s[args.kv][-1]:.1f} tok/s",
              flush=True)
    ratio = statistics.median(b / a for a, b in zip(tok_s["auto"], tok_s[args.kv]))
    same = sum(x == y for x, y in zip(tokens["auto"], tokens[args.kv]))
    print(f"median {args.kv} / float32: {ratio:.3f}; tokens agreeing: {same}/{len(tokens['auto'])}")
    for llm in llms.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
