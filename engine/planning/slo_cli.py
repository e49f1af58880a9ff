"""`engine plan serve --slo`: flags, the device (a GPU preset or this CPU, measured), the table and the
`engine serve` command of the plan."""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import asdict
from pathlib import Path

from engine.planning.argtypes import positive_float, positive_int
from engine.planning.hardware import GPUS
from engine.planning.slo import NO_SPECULATION, Device, SloError, Speculation, Workload, plan_slo, predict_closed_loop
from engine.planning.spec import ModelSpec
from engine.planning.steptime import DEFAULT_COMPUTE_EFFICIENCY
from engine.planning.units import GiB, dtype_bytes
from engine.planning.weight_formats import ENGINE_FORMATS

# A preset names a shape, not weights on this machine: its command reads the model's folder from $MODEL.
MODEL_VARIABLE = "$MODEL"


def lengths(text: str) -> tuple[int, ...]:
    """"512" or an empirical distribution "128,512,2048" (each value equally likely)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be token counts such as 512 or 128,512,2048, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"must be positive token counts, got {text!r}")
    return values


def counts(text: str) -> list[int]:
    return [positive_int(v) for v in text.split(",")]


def add_slo_flags(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group("--slo: a serving plan from latency targets (replicas x TP, max_num_seqs, KV budget)")
    g.add_argument("--slo", action="store_true", help="plan from --request-rate, lengths and TTFT / TPOT targets")
    g.add_argument("--request-rate", type=positive_float, help="requests per second arriving (Poisson)")
    g.add_argument("--prompt-len", type=lengths, default=(512,), help="prompt tokens: a value or a list of values")
    g.add_argument("--output-len", type=lengths, default=(256,), help="output tokens: a value or a list of values")
    g.add_argument("--ttft-ms", type=positive_float, help="time-to-first-token target, ms")
    g.add_argument("--tpot-ms", type=positive_float, help="time-per-output-token target, ms")
    g.add_argument("--max-gpus", type=positive_int, default=64, help="most GPUs the plan may use")
    g.add_argument("--gpus-per-node", type=positive_int, default=8, help="TP stays within a node's GPUs")
    g.add_argument("--num-speculative-tokens", type=positive_int, default=None, metavar="K",
                   help="speculative decoding: K draft tokens verified a decode step (engine serve's "
                        "--speculative-config num_speculative_tokens; default: none); needs --acceptance-rate")
    g.add_argument("--acceptance-rate", type=_probability, default=None, metavar="A",
                   help="with --num-speculative-tokens: the chance each draft token is accepted (engine bench "
                        "reports the mean accepted length L; for K drafts, A solves (1 - A^(K+1)) / (1 - A) = L)")
    g.add_argument("--concurrency", type=counts,
                   help="instead: predict TPOT / TTFT / throughput of one replica at these closed-loop concurrencies "
                        "(as `engine bench serve --max-concurrency` measures them)")


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1], got {text!r}")
    return value


def speculation(args: argparse.Namespace) -> Speculation:
    if (args.num_speculative_tokens is None) != (args.acceptance_rate is None):
        given = "--num-speculative-tokens" if args.acceptance_rate is None else "--acceptance-rate"
        other = "--acceptance-rate" if args.acceptance_rate is None else "--num-speculative-tokens"
        args.parser.error(f"argument {given}: needs {other} too (speculation is K drafts accepted at a rate)")
    if args.num_speculative_tokens is None:
        return NO_SPECULATION
    return Speculation(args.num_speculative_tokens, args.acceptance_rate)


def engine_quantizations() -> tuple[str, ...]:
    """The planner's --quantization methods `engine serve --quantization` takes too; a GGUF's block type is the
    file's own and needs no flag."""
    import engine.config

    return tuple(f.name for f in ENGINE_FORMATS if f.name in getattr(engine.config, "QUANTIZATIONS", ()))


def device(args: argparse.Namespace, spec: ModelSpec) -> Device:
    if args.gpu == "cpu":
        from engine.planning.measure import measure_cpu  # imports torch: only here

        if spec.is_moe:
            args.parser.error("argument --gpu: cpu measures a dense model's layers; for a mixture-of-experts model "
                              "give a GPU preset or --peak-tflops and --hbm-tbps")
        if args.weights is not None:
            flag = "--quantization" if args.quantization is not None else "--weight-format"
            args.parser.error(f"argument {flag}: --gpu cpu times the layers with float weights (measure.py); a "
                              "quantized plan needs a GPU preset or --peak-tflops and --hbm-tbps")
        dtype = "bfloat16" if args.dtype == "auto" else args.dtype
        return measure_cpu(spec, dtype, prompt=round(sum(args.prompt_len) / len(args.prompt_len)),
                           budget=args.max_num_batched_tokens or 2048)
    missing = [flag for flag, value in (("--gpu-memory-gib", args.gpu_memory_gib), ("--peak-tflops", args.peak_tflops),
                                        ("--hbm-tbps", args.hbm_tbps)) if value is None]
    if missing:
        args.parser.error(f"argument --gpu: --slo needs a GPU preset ({', '.join(GPUS)}, or cpu) or "
                          f"{', '.join(missing)}")
    return Device(name=args.gpu or "custom GPU", memory_bytes=int(args.gpu_memory_gib * GiB),
                  flops=args.peak_tflops * 1e12, memory_bw=args.hbm_tbps * 1e12,
                  link_bw=None if args.intra_node_gbps is None else args.intra_node_gbps * 1e9,
                  efficiency=DEFAULT_COMPUTE_EFFICIENCY)


def run_slo(args: argparse.Namespace, spec: ModelSpec) -> int:
    dtype = "bfloat16" if args.dtype == "auto" else args.dtype
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    nbytes, kv_bytes = dtype_bytes(dtype), dtype_bytes(kv_dtype)
    load = Workload(args.prompt_len, args.output_len)
    spec_decode = speculation(args)
    dev = device(args, spec)
    if args.gpu == "cpu" and args.kv_cache_memory is None:
        args.parser.error("argument --kv-cache-memory: on a CPU give the KV budget (e.g. 2GiB), as `engine serve` does")
    if args.concurrency:
        rows = [asdict(predict_closed_loop(spec, dev, load, c, dtype_bytes=nbytes, kv_dtype_bytes=kv_bytes,
                                           budget=args.max_num_batched_tokens or 2048,
                                           weight_format=args.weights, speculation=spec_decode))
                for c in args.concurrency]
        table = "\n".join([f"{spec.name} on {dev.name}: {load.prompt:g} prompt / {load.output:g} output tokens",
                           "concurrency  TTFT ms  TPOT ms  output tok/s"]
                          + [f"{r['concurrency']:>11g}  {r['ttft'] * 1e3:7.1f}  {r['tpot'] * 1e3:7.2f}  "
                             f"{r['throughput']:12.1f}" for r in rows])
        print(json.dumps({"device": asdict(dev), "predictions": rows}, indent=2) if args.json else table)
        return 0
    missing = [f for f, v in (("--request-rate", args.request_rate), ("--ttft-ms", args.ttft_ms),
                              ("--tpot-ms", args.tpot_ms)) if v is None]
    if missing:
        args.parser.error(f"argument --slo: needs {', '.join(missing)}")
    cpu = args.gpu == "cpu"
    tp_sizes = [1] if cpu else [t for t in range(1, args.gpus_per_node + 1)
                                if args.gpus_per_node % t == 0 and spec.num_heads % t == 0
                                and (dev.link_bw is not None or t == 1)]
    try:
        plan = plan_slo(spec, dev, load, rate=args.request_rate, ttft=args.ttft_ms / 1e3, tpot=args.tpot_ms / 1e3,
                        tp_sizes=tp_sizes, max_gpus=1 if cpu else args.max_gpus, dtype_bytes=nbytes,
                        kv_dtype_bytes=kv_bytes, kv_cache_memory_bytes=args.kv_cache_memory,
                        gpu_memory_utilization=args.gpu_memory_utilization, block_size=args.block_size,
                        weight_format=args.weights, speculation=spec_decode)
    except SloError as e:
        args.parser.error(f"argument --{e.setting.replace('_', '-')}: {e.message}")
    weights = _weights_path(args.model)
    command = ["engine", "serve", "--model", MODEL_VARIABLE if weights is None else str(weights), "--dtype", dtype,
               "--max-num-seqs", str(plan.max_num_seqs), "--max-model-len", str(load.longest)]
    if args.weights is not None and args.weights.name in engine_quantizations():
        command += ["--quantization", args.weights.name] + ["--quantize-lm-head"] * args.weights.lm_head
    if plan.tp > 1:
        command += ["--tensor-parallel-size", str(plan.tp)]
    if plan.replicas > 1:
        command += ["--data-parallel-size", str(plan.replicas)]
    if spec_decode.k:
        command += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": spec_decode.k})]
    command += (["--kv-cache-memory", str(args.kv_cache_memory)] if args.kv_cache_memory is not None
                else ["--gpu-memory-utilization", str(args.gpu_memory_utilization)])
    p = plan.prediction
    line = shlex.join(command).replace(shlex.quote(MODEL_VARIABLE), '"$MODEL"')
    payload = {"model": spec.name, "device": asdict(dev), **asdict(plan), "command": line}
    table = "\n".join([
        f"{spec.name} on {dev.name}: {args.request_rate:g} requests/s of {load.prompt:g} prompt / {load.output:g} "
        f"output tokens; targets TTFT {args.ttft_ms:g} ms, TPOT {args.tpot_ms:g} ms",
        f"layout          {plan.replicas} replica(s) x TP {plan.tp} = {plan.gpus} GPU(s)",
        *([f"weights         linear layers in {args.weights.name} ({args.weights.bits_per_weight:g} bits a weight, "
            "scales included)" + (f", LM head in {args.weights.head_as}" if args.weights.lm_head else "")]
          if args.weights else []),
        *([f"speculation     {spec_decode.k} drafts a step, each accepted at {spec_decode.acceptance:g}: "
            f"{spec_decode.tokens_per_step:.2f} tokens a verify step"] if spec_decode.k else []),
        f"max_num_seqs    {plan.max_num_seqs} (running per replica predicted: {p.concurrency:,.1f})",
        f"KV budget       {plan.kv_budget_bytes / GiB:,.2f} GiB per GPU = {plan.kv_capacity_tokens:,} tokens",
        f"predicted       TTFT {p.ttft * 1e3:,.1f} ms, TPOT {p.tpot * 1e3:,.2f} ms, {p.throughput:,.1f} output tok/s",
        "",
        *([f"# MODEL: the folder of {spec.name}'s config.json and safetensors, or its .gguf file"]
          if weights is None else []),
        line,
    ])
    print(json.dumps(payload, indent=2) if args.json else table)
    return 0


def _weights_path(model: str) -> Path | None:
    """What `engine serve --model` takes for the plan's --model: its folder for a config.json or a
    folder, None for a preset (no weights here to point at)."""
    path = Path(model)
    if not path.exists():
        return None
    return path.parent if path.is_file() and path.name == "config.json" else path
