"""`engine serve | generate | bench | plan` (also `python -m engine`).

The one place that reaches up to `server`. `engine plan` is dispatched before anything else is
imported, so it never loads torch, FastAPI or the model code.
"""

from __future__ import annotations

import argparse
import logging
import sys

import engine
from engine.arg_utils import (SERVING_ONLY, ArgumentParser, add_engine_args, add_log_level, engine_config_kwargs,
                              unrecognized, walk_parsers)
from engine.loading.default_model import USER_ERRORS


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts (offline)",
                       description="Generate text for each prompt with the offline engine and print it.\n"
                                   "Greedy by default; --temperature > 0 samples, reproducibly for one --seed.")
    p.add_argument("prompts", nargs="+", help="prompt text(s)")
    g = p.add_argument_group("sampling (per request)")
    g.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per output")
    g.add_argument("--n", type=int, default=1, help="outputs per prompt (each printed after the prompt)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (argmax)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens "
                                                             "holding this much probability")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0: all")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens less likely than min-p x the most "
                                                             "likely one; 0: off")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop an output at this text, which is left out (repeatable; default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    add_engine_args(p, skip=SERVING_ONLY)  # --seed among them: the sampler's seed, so outputs repeat
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    from engine.frontend.llm import LLM
    from engine.sampling_params import SamplingParams

    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, stop=args.stop, ignore_eos=args.ignore_eos)
    with LLM(**engine_config_kwargs(args)) as llm:
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False)
        else:
            outs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, out in zip(args.prompts, outs):
        for choice in out.outputs:
            print(choice.text if args.chat else prompt + choice.text, flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="engine", description="pagewise: serve, run, benchmark and plan LLMs")
    parser.add_argument("--version", action="version", version=f"pagewise {engine.__version__}")
    add_log_level(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,bench,plan}")
    from server.cli import add_parser as add_serve

    add_serve(sub)
    _add_generate(sub)
    from engine.bench.cli import add_parser as add_bench

    add_bench(sub)
    from engine.planning.cli import add_parser as add_plan

    add_plan(sub)
    for _, p in list(walk_parsers(parser))[1:]:
        if "--log-level" not in p._option_string_actions:
            add_log_level(p, top=False)
    return parser


def _plan_argv(argv: list[str]) -> list[str] | None:
    """argv for `engine.planning.cli.main` when the command is `plan` (with at most --log-level
    before it), else None. This fast path is what keeps `engine plan` instant."""
    i = 0
    while i < len(argv) and argv[i].startswith("--log-level"):
        i += 1 if "=" in argv[i] else 2
    if i < len(argv) and argv[i] == "plan":
        return argv[:i] + argv[i + 1:]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    plan_argv = _plan_argv(argv)
    if plan_argv is not None:  # instant start: no torch, no server imports
        from engine.planning.cli import main as plan_main

        return plan_main(plan_argv)
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)  # a subcommand's unknown flags come back here
    if extras:
        prog = " ".join(["engine", args.command, *filter(None, [getattr(args, "bench_mode", None)])])
        parser.exit(2, f"{prog}: error: {unrecognized(extras, prog)}\n")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except USER_ERRORS as e:  # a setting the user can fix: say what, not where
        print(f"engine {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
