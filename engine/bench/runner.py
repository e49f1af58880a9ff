"""Glue for the three modes: check the settings and the environment, resolve them once, draw
requests, run, report.

Everything a user can get wrong (flags that do not fit together, a missing optional package, a
vLLM interpreter that cannot import vLLM, an engine setting out of range) fails here, in one
line with exit status 2, before any work. A `--compare` parent (or a vllm run under
`--vllm-python`) delegates each backend to a child process (compare.py); a child, or a plain
single-backend run, works in-process (offline.py). `serve` always runs in-process, against a URL
or servers it launches (online.py).
"""

from __future__ import annotations

import json
import os
import sys

from engine.bench import checks, report
from engine.bench.checks import fail
from engine.bench.common import load_tokenizer, parse_concurrency_levels, parse_kv, parse_percentiles, report_settings
from engine.bench.datasets import build_requests, load_requests, random_requests

OFFLINE_BACKENDS = ("engine", "hf", "vllm", "llamacpp")


def resolve_model(model: str | None) -> str:
    if model:
        return os.path.expanduser(model)
    try:
        from engine.loading.default_model import default_model_path

        return str(default_model_path())
    except (ImportError, OSError) as e:
        fail(f"no --model given and the default model is unavailable ({e}); pass --model PATH")


def resolve_dtype(dtype: str, device: str = "auto", model: str | None = None) -> str:
    """The dtype every backend of a run computes in: the engine's own reading of "auto" for this
    model on this device (engine.runner.model_runner.resolve_dtype), named, so the peers get the same."""
    if dtype != "auto":
        return dtype
    from engine.loading.hub import resolve_config_dir
    from engine.loading.loader import stored_dtype
    from engine.runner.model_runner import resolve_device, resolve_dtype as engine_dtype

    try:  # a served model's name (bench serve against a URL) has no folder to read: CPU "auto" -> float32
        stored = stored_dtype(resolve_config_dir(model)) if model else None
    except (OSError, ValueError):
        stored = None
    return str(engine_dtype("auto", resolve_device(device), stored)).removeprefix("torch.")


def validate(args) -> None:
    """Settings that parse one by one but not together: exit 2 before any work."""
    from engine.bench.metrics import parse_goodput

    try:
        args.percentiles = parse_percentiles(args.percentiles)
        if args.bench_mode == "serve":
            args.goodput_slos = parse_goodput(args.goodput)
            args.concurrency_levels = parse_concurrency_levels(args.max_concurrency)
        else:
            args.vllm_kwargs = parse_kv(args.vllm_arg)
    except Exception as e:
        fail(str(e))
    if args.bench_mode != "latency":
        validate_dataset(args)
    if args.bench_mode == "serve":
        if not args.launch and not args.base_url:
            fail("give --base-url URL (a running server) or --launch engine|vllm[,...] (servers the bench starts)")
        if args.result_dir or args.result_filename:
            args.save_result = True
        if args.save_result:
            try:
                os.makedirs(args.result_dir or ".", exist_ok=True)
            except OSError as e:
                fail(f"--result-dir {args.result_dir}: {e}")
        return
    args.backends = [b.strip() for b in args.compare.split(",") if b.strip()] if args.compare else [args.backend]
    unknown = [b for b in args.backends if b not in OFFLINE_BACKENDS]
    if unknown or not args.backends:
        fail(f"--compare takes backends from {', '.join(OFFLINE_BACKENDS)}, e.g. engine,hf; got {args.compare!r}")
    if "llamacpp" in args.backends and (args.bench_mode != "latency" or args.batch_size != 1):
        fail("llamacpp (llama-cpp-python) decodes one sequence at a time: use it with `engine bench latency "
             "--batch-size 1`; for llama.cpp's batched server use `engine bench serve --launch llamacpp`")
    if args.bench_mode == "latency":
        for flag, value, low in (("--batch-size", args.batch_size, 1), ("--input-len", args.input_len, 1),
                                 ("--output-len", args.output_len, 1), ("--num-iters", args.num_iters, 1),
                                 ("--num-iters-warmup", args.num_iters_warmup, 0)):
            if value < low:
                fail(f"{flag} must be >= {low}, got {value}")


def validate_dataset(args) -> None:
    if args.dataset_name is None:
        args.dataset_name = "sharegpt" if args.dataset_path else "random"
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            fail("--dataset-name sharegpt reads --dataset-path FILE.json: give it")
        if not os.path.isfile(args.dataset_path):
            fail(f"--dataset-path {args.dataset_path}: no such file")
    elif args.dataset_path:
        fail("--dataset-path is a ShareGPT file: add --dataset-name sharegpt, or drop it for random prompts")
    if args.num_prompts < 1:
        fail(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.dataset_name == "random":
        if args.input_len < 1 or args.output_len < 1:
            fail(f"--random-input-len and --random-output-len must be >= 1, got {args.input_len} and {args.output_len}")
        if not 0.0 <= args.range_ratio < 1.0:
            fail(f"--random-range-ratio must be in [0, 1), got {args.range_ratio}")


def check_engine_config(args) -> None:
    """The engine flags make a valid EngineConfig (the same validation as `engine serve`)."""
    from engine.arg_utils import engine_config_from_args

    try:
        engine_config_from_args(args)
    except ValueError as e:
        fail(str(e))


def absolute_paths(args) -> None:
    """Launched servers and --compare children run in the package's folder: give them absolute paths."""
    for name in ("model", "tokenizer", "chat_template"):
        path = getattr(args, name, None)
        if path and os.path.exists(os.path.expanduser(path)):  # a chat template may be Jinja text
            setattr(args, name, os.path.abspath(os.path.expanduser(path)))


def run(args) -> int:
    from engine.bench.compare import child_argv

    if args.bench_mode != "serve" and args.requests_file:  # a --compare child: the parent checked it all
        args.percentiles = parse_percentiles(args.percentiles)
        args.vllm_kwargs = parse_kv(args.vllm_arg)
        return run_child(args)
    absolute_paths(args)
    base_argv = child_argv(args._parser, args) if args.bench_mode != "serve" else []  # before validate() parses
    validate(args)
    checks.check_environment(args)
    args.model = resolve_model(args.model)
    args.dtype = resolve_dtype(args.dtype, args.device, args.model)
    check_engine_config(args)
    report.warn_if_busy()
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


def measured_requests(args, requests) -> int:
    """The requests the reported numbers cover: latency counts only the measured full batches."""
    return args.num_iters * args.batch_size if args.bench_mode == "latency" else len(requests)


def run_offline(args, base_argv: list[str]) -> int:
    from engine.bench.compare import run_children

    backends = args.backends
    requests = draw_offline_requests(args, load_tokenizer(args.tokenizer or args.model))
    # Children always get the resolved model and dtype, and the threads when pinned (unpinned, the
    # engine child follows the load and every peer child takes all cores).
    base_argv = base_argv + ["--model", args.model, "--dtype", args.dtype]
    if args.num_threads is not None:
        base_argv += ["--num-threads", str(args.num_threads)]
    delegate = args.compare or (args.backend == "vllm" and args.vllm_python
                                and os.path.realpath(args.vllm_python) != os.path.realpath(sys.executable))
    if delegate:
        results = run_children(args.bench_mode, args, base_argv, requests, backends)
    else:
        results = [in_process(args, requests)]
    for r in results:
        if "error" in r:
            print(f"\n[{r['backend']}] {r['error']}", file=sys.stderr)
    num_requests = measured_requests(args, requests)
    first = requests[0]
    if args.bench_mode == "throughput":
        print("\n" + report.throughput_table(results, baseline=backends[0] if "engine" not in backends else "engine"))
        counted = f"{num_requests} requests"
        if (line := report.speculation_line(results)) is not None:
            print(line)
    else:
        print("\n" + report.latency_table(results, args.percentiles))
        counted = (f"{num_requests} requests ({args.num_iters} measured batches of {args.batch_size}; "
                   f"{args.num_iters_warmup} warm-up iterations not counted)")
    print(f"\nmodel {args.model}, dtype {args.dtype}, threads {args.num_threads or 'default'}, {counted} "
          f"(first: {first.prompt_len} prompt + {first.output_len} output tokens), EOS ignored, greedy")
    out = {"mode": args.bench_mode, "settings": report_settings(args), "environment": report.environment(),
           "num_requests": num_requests, "results": results}
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
