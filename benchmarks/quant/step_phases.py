"""Where a batch-1 decode step's wall time goes, phase by phase: each engine method below is
wrapped with a perf_counter accumulator (~1 us a call, far below cProfile's distortion), one
request of --new-tokens generates after a --prompt-len prompt, and each phase's microseconds per
step (prefill included, amortized) are printed per round.

    python benchmarks/quant/step_phases.py [--model FILE] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import time


def main() -> None:
    from engine import LLM, SamplingParams
    from engine.loading.default_model import default_gguf_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the default model's Q4_1 file")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=2)
    args = p.parse_args()
    llm = LLM(model=args.model or default_gguf_path(), num_threads=args.num_threads)
    spent: dict[str, float] = collections.defaultdict(float)

    def wrap(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] += time.perf_counter() - start

        object.__setattr__(obj, name, timed)  # the backend is a frozen dataclass

    engine, runner = llm.engine, llm.engine.runner
    model = runner.model
    for obj, name, label in (
            (llm, "_step", "0 LLM._step (all)"), (engine, "step", "1 core.step"),
            (engine.scheduler, "schedule", "2 schedule"), (llm.output_processor, "process", "2 output processing"),
            (runner, "execute_model", "3 execute_model"), (runner, "_prepare_inputs", "4 prepare inputs"),
            (runner, "_forward", "4 forward"), (runner, "_sample", "4 sample"),
            (runner.backend, "plan_attention", "5 plan attention"), (model.model.embed_tokens, "forward", "5 embed"),
            (model.model.rotary, "forward", "5 rotary"), (model.model, "fused_layers", "5 fused layers"),
            (model, "final_hidden", "5 final norm"), (model, "compute_logits", "5 LM head")):
        wrap(obj, name, label)
    prompt = list(range(100, 100 + args.prompt_len))
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    for r in range(args.rounds):
        spent.clear()
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        wall = time.perf_counter() - start
        print(f"round {r}: {args.new_tokens / wall:.1f} tok/s (prefill included)")
        for label in sorted(spent):
            print(f"   {label:28s} {1e6 * spent[label] / args.new_tokens:8.1f} us/step")
    llm.shutdown()


if __name__ == "__main__":
    main()
