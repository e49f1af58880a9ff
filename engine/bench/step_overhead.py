"""How long an engine step takes outside the model forward, early and late in a long generation.

    python -m engine.bench.step_overhead --max-tokens 4096 --dtype bfloat16

One request generates --max-tokens tokens (greedy, EOS ignored, with logprobs and a stop string
so that every per-token path runs). Each step is timed whole (scheduling, batch building,
sampling, the core's bookkeeping, and the front end's output processing: detokenizing, stop
strings, logprobs, the delta handed to a stream) and the model forward (layers and LM head) is
timed inside it; the difference is the step's overhead. Medians over a window of steps around each mark are printed as
JSON: work per step that grows with the output shows as a ratio above 1.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time

WINDOW = 50  # steps in each median


@contextlib.contextmanager
def timed_forward(model):
    """Within the block, every model forward (the layers and the LM head; sampling is not in it)
    adds its seconds to the one-element list yielded; the caller resets it between steps."""
    forward = [0.0]

    def timed(fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            forward[0] += time.perf_counter() - start
            return out
        return call

    names = ("forward", "compute_logits")
    for name in names:
        setattr(model, name, timed(getattr(model, name)))
    try:
        yield forward
    finally:
        for name in names:
            delattr(model, name)  # back to the class's methods


def measure(llm, max_tokens: int, marks: list[int]) -> dict:
    from engine.sampling_params import SamplingParams

    core = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5,
                            stop=["a stop string that never appears"])
    prompt = llm.tokenizer("Write a very long story about a lighthouse keeper.")["input_ids"]
    core.add_request("overhead", prompt, params)
    llm.output_processor.add_request("overhead", None, prompt, params, delta=True)  # as the server streams
    overhead_ms = []
    with timed_forward(core.runner.model) as forward:
        while len(overhead_ms) < max_tokens:
            forward[0] = 0.0
            start = time.perf_counter()
            llm._step()
            overhead_ms.append((time.perf_counter() - start - forward[0]) * 1e3)
    at = {m: statistics.median(overhead_ms[max(0, m - WINDOW // 2): m + WINDOW // 2]) for m in marks}
    return {"max_tokens": max_tokens, "overhead_ms_at_token": at, "ratio_last_to_first": at[marks[-1]] / at[marks[0]]}


def main(argv: list[str] | None = None) -> int:
    from engine.arg_utils import ArgumentParser

    p = ArgumentParser(prog="python -m engine.bench.step_overhead", description=__doc__)
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens generated")
    p.add_argument("--marks", default="100,4000", help="tokens at which the overhead is reported")
    p.add_argument("--dtype", default="bfloat16", help="the engine's dtype")
    p.add_argument("--model", default=None, help="model folder (default: the embedded default model)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    marks = [int(m) for m in args.marks.split(",")]
    if max(marks) + WINDOW // 2 > args.max_tokens:
        p.error(f"--marks must stay {WINDOW // 2} tokens below --max-tokens")

    from engine.frontend.llm import LLM

    context = args.max_tokens + 128
    llm = LLM(args.model, dtype=args.dtype, max_model_len=context, num_kv_blocks=context // 16 + 8,
              num_threads=args.num_threads)
    print(json.dumps(measure(llm, args.max_tokens, marks)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
