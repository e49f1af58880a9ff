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
                                   "Greedy by default (unless the model's generation_config.json sets a "
                                   "temperature: see --generation-config);\n--temperature > 0 samples, "
                                   "reproducibly for one --seed.")
    p.add_argument("prompts", nargs="+", help="prompt text(s)")
    g = p.add_argument_group("sampling (per request)")
    g.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    model = "the model's generation_config.json's (--generation-config), else"
    g.add_argument("--max-tokens", type=int, default=None, help=f"most tokens generated per output (default: {model} "
                                                                "64)")
    g.add_argument("--n", type=int, default=1, help="outputs per prompt (each printed after the prompt)")
    g.add_argument("--temperature", type=float, default=None, help=f"0: greedy (argmax) (default: {model} 0)")
    g.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the smallest set of tokens "
                                                              f"holding this much probability (default: {model} 1)")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens; 0: all "
                                                            f"(default: {model} 0)")
    g.add_argument("--min-p", type=float, default=None, help="drop tokens less likely than min-p x the most "
                                                              f"likely one; 0: off (default: {model} 0)")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"penalize the tokens already in the prompt or output (> 1); 1: off (default: "
                        f"{model} 1)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop an output at this text, which is left out (repeatable; default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    add_engine_args(p, skip=SERVING_ONLY)  # --seed among them: the sampler's seed, so outputs repeat
    p.set_defaults(func=_run_generate)


# What `engine generate` samples with where neither its flags nor the model's sampling defaults say.
GENERATE_DEFAULTS = {"temperature": 0.0, "max_tokens": 64}


def _run_generate(args) -> int:
    from engine.config import EngineConfig
    from engine.loading import hub
    from engine.loading.sampling_defaults import read_sampling_defaults
    from engine.sampling_params import SamplingParams

    config = EngineConfig(**engine_config_kwargs(args))  # a bad setting fails before torch loads
    defaults = read_sampling_defaults(config.generation_config, hub.model_path(config))
    flags = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
             "top_k": args.top_k, "min_p": args.min_p, "repetition_penalty": args.repetition_penalty}
    settings = {**GENERATE_DEFAULTS, **defaults.as_dict(), **{k: v for k, v in flags.items() if v is not None}}
    params = SamplingParams(n=args.n, stop=args.stop, ignore_eos=args.ignore_eos, **settings)
    from engine.frontend.llm import LLM

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
