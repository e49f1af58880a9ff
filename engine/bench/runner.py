"""Glue for the three modes: resolve settings once, draw requests, run, report.

A `--compare` parent (or a vllm run under `--vllm-python`) delegates each backend to a
child process (compare.py); a child, or a plain single-backend run, works in-process
(offline.py). `serve` always runs in-process, against a URL or servers it launches (online.py).
"""

from __future__ import annotations

import json
import os
import sys

from engine.bench import report
from engine.bench.datasets import build_requests, load_requests, random_requests


def resolve_model(model: str | None) -> str:
    if model:
        return os.path.expanduser(model)
    try:
        from engine.default_model import default_model_path
    except ImportError as e:
        raise SystemExit(f"no --model given and the default model is unavailable ({e}); pass --model PATH") from None
    return str(default_model_path())


def resolve_dtype(dtype: str, device: str = "auto") -> str:
    if dtype != "auto":
        return dtype
    import torch

    return "bfloat16" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "float32"


def load_tokenizer(path: str):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)


def settings(args) -> dict:
    return {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("func",)}


def run(args) -> int:
    from engine.bench.compare import child_argv
    from engine.bench.cli import _percentiles, parse_kv
    from engine.bench.metrics import parse_goodput

    base_argv = child_argv(args._parser, args)  # before any normalisation below
    try:
        args.percentiles = _percentiles(args.percentiles)
        if args.bench_mode == "serve":
            args.goodput_slos = parse_goodput(args.goodput)
    except Exception as e:
        raise SystemExit(f"engine bench: {e}") from None
    if args.bench_mode != "serve":
        args.engine_kwargs = parse_kv(args.engine_arg)
        args.vllm_kwargs = parse_kv(args.vllm_arg)
        if args.requests_file:  # a child of --compare
            return run_child(args)
    report.warn_if_busy()
    args.model = resolve_model(args.model)
    args.dtype = resolve_dtype(args.dtype, getattr(args, "device", "auto"))
    if args.bench_mode == "serve":
        from engine.bench.online import run_serve

        return run_serve(args)
    return run_offline(args, base_argv)


def run_child(args) -> int:
    from engine.bench.backends.vllm import VLLMUnavailable
    from engine.bench.offline import run_latency, run_throughput

    requests = load_requests(args.requests_file)
    try:
        result = (run_throughput if args.bench_mode == "throughput" else run_latency)(args, requests)
        code = 0
    except VLLMUnavailable as e:
        result, code = {"backend": args.backend, "error": str(e)}, 3
    except Exception as e:
        import traceback

        traceback.print_exc()
        result, code = {"backend": args.backend, "error": f"{type(e).__name__}: {e}"}, 1
    result["environment"] = report.environment()
    with open(args.result_json, "w", encoding="utf-8") as f:
        json.dump(result, f, default=str)
    return code


def draw_offline_requests(args, tokenizer):
    if args.bench_mode == "throughput":
        return build_requests(args, tokenizer, max_model_len=args.max_model_len)
    # latency: two fresh batches per iteration (prefill-only for TTFT, then the full one)
    n = 2 * (args.num_iters_warmup + args.num_iters) * args.batch_size
    return random_requests(tokenizer, n, args.input_len, args.output_len, 0.0, args.seed)


def run_offline(args, base_argv: list[str]) -> int:
    from engine.bench.compare import run_children

    backends = [b.strip() for b in args.compare.split(",")] if args.compare else [args.backend]
    unknown = [b for b in backends if b not in ("engine", "hf", "vllm")]
    if unknown:
        raise SystemExit(f"--compare: unknown backend(s) {unknown}; choose from engine, hf, vllm")
    requests = draw_offline_requests(args, load_tokenizer(args.tokenizer or args.model))
    # Children always get the resolved model / dtype / threads, whatever the defaults were.
    base_argv = base_argv + ["--model", args.model, "--dtype", args.dtype, "--num-threads", str(args.num_threads)]
    delegate = args.compare or (args.backend == "vllm" and args.vllm_python
                                and os.path.realpath(args.vllm_python) != os.path.realpath(sys.executable))
    if delegate:
        results = run_children(args.bench_mode, args, base_argv, requests, backends)
    else:
        results = [in_process(args, requests)]
    for r in results:
        if "error" in r:
            print(f"\n[{r['backend']}] {r['error']}", file=sys.stderr)
    if args.bench_mode == "throughput":
        print("\n" + report.throughput_table(results, baseline=backends[0] if "engine" not in backends else "engine"))
    else:
        print("\n" + report.latency_table(results, args.percentiles))
    first = requests[0]
    print(f"\nmodel {args.model}, dtype {args.dtype}, threads {args.num_threads}, {len(requests)} requests "
          f"(first: {first.prompt_len} prompt + {first.output_len} output tokens), EOS ignored, greedy")
    out = {"mode": args.bench_mode, "settings": settings(args), "environment": report.environment(),
           "num_requests": len(requests), "results": results}
    if args.output_json:
        report.write_json(args.output_json, out)
    if args.plot:
        from engine.bench import plot

        if args.bench_mode == "throughput":
            plot.plot_throughput(results, args.plot)
        else:
            plot.plot_latency(results, args.plot, args.percentiles)
    failed = [r for r in results if "error" in r]
    mismatch = [r for r in results if not r.get("token_count_ok", True)]
    return 1 if failed or mismatch else 0


def in_process(args, requests) -> dict:
    from engine.bench.backends.vllm import VLLMUnavailable
    from engine.bench.offline import run_latency, run_throughput

    try:
        return (run_throughput if args.bench_mode == "throughput" else run_latency)(args, requests)
    except VLLMUnavailable as e:
        return {"backend": args.backend, "error": str(e)}
