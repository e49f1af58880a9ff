"""`engine serve | generate | bench | plan`.

The one place that reaches up to `server`: the `serve` sub-command is registered lazily so
that `engine plan` never imports torch, FastAPI or the model code.
"""

from __future__ import annotations

import argparse
import logging
import sys

from engine.arg_utils import add_engine_args, engine_config_kwargs


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one or more prompts (offline)")
    p.add_argument("prompts", nargs="+", help="prompt text(s)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message with the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed)
    llm = LLM(**engine_config_kwargs(args))
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, out in zip(args.prompts, outs):
        text = out.outputs[0].text
        print(text if args.chat else prompt + text, flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine", description="pagewise: serve, run, benchmark and plan LLMs")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    from server.cli import add_parser as add_serve

    add_serve(sub)
    _add_generate(sub)
    from engine.bench.cli import add_parser as add_bench

    add_bench(sub)
    from engine.planning.cli import add_parser as add_plan

    add_plan(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "plan":  # instant start: no torch, no server imports
        from engine.planning.cli import main as plan_main

        return plan_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except ValueError as e:  # a setting the user can fix: say what, not where
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
