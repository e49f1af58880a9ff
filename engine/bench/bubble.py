"""Measure the pipeline bubble: one workload run with one micro-batch per step (stages take
turns) and with one micro-batch per stage (stages overlap), printing for each the wall time,
rank 0's step time, every stage's busy time and the bubble, next to the ideal (p - 1) / (m + p - 1).

    python -m engine.bench.bubble --model ./my-model --pipeline-parallel-size 2 --num-prompts 32

Without --model it measures the embedded default model, as the other commands do.

Each rank gets one CPU thread (--num-threads), so on CPU the stages need a core each to overlap.
"""

from __future__ import annotations

import time

from engine.executor.executor import pipeline_bubble

_TIMED = ("steps", "step_s", "compute_s", "recv_wait_s", "busy_s")


def measure(model: str, tp: int, pp: int, micro_batches: int, num_prompts: int, prompt_len: int, max_tokens: int,
            **engine_args) -> dict:
    from engine.frontend.llm import LLM
    from engine.sampling_params import SamplingParams

    prompts = [[(7 * i + j) % 200 + 10 for j in range(prompt_len)] for i in range(num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_micro_batches=micro_batches,
             **engine_args) as llm:
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up, not counted
        before = llm.engine.runner.rank_reports()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = llm.engine.runner.rank_reports()
    reports = [{**a, **{k: a[k] - b[k] for k in _TIMED}} for a, b in zip(after, before)]
    return {
        "micro_batches": micro_batches, "wall_s": wall, "steps": reports[0]["steps"], "step_s": reports[0]["step_s"],
        "stage_busy_s": [r["busy_s"] for r in reports if r["tp_rank"] == 0],
        "bubble": pipeline_bubble(reports, pp), "ideal": (pp - 1) / (micro_batches + pp - 1),
    }


def main(argv: list[str] | None = None) -> None:
    from engine.arg_utils import ArgumentParser
    from engine.loading.default_model import USER_ERRORS

    p = ArgumentParser(prog="python -m engine.bench.bubble", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model folder or .gguf file (default: the embedded default model)")
    p.add_argument("--pipeline-parallel-size", type=int, default=2)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-threads", type=int, default=1)
    args = p.parse_args(argv)
    pp = args.pipeline_parallel_size
    print(f"pp {pp}, tp {args.tensor_parallel_size}: {args.num_prompts} prompts of {args.prompt_len} tokens, "
          f"{args.max_tokens} generated each")
    print(f"{'micro-batches':>13} {'steps':>6} {'wall s':>7} {'step s':>7} {'stage busy s':>20} "
          f"{'bubble':>7} {'ideal':>6}")
    for m in (1, pp):
        try:
            r = measure(args.model, args.tensor_parallel_size, pp, m, args.num_prompts, args.prompt_len,
                        args.max_tokens, max_num_batched_tokens=args.max_num_batched_tokens,
                        num_threads=args.num_threads)
        except USER_ERRORS as e:  # a setting the user can fix: one line, as every command says it
            p.exit(2, f"{p.prog}: error: {e}\n")
        busy = " ".join(f"{b:.2f}" for b in r["stage_busy_s"])
        print(f"{m:>13} {r['steps']:>6} {r['wall_s']:>7.2f} {r['step_s']:>7.2f} {busy:>20} "
              f"{r['bubble']:>7.0%} {r['ideal']:>6.0%}")


if __name__ == "__main__":
    main()
