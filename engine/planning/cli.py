"""`engine plan train | serve | search`: the estimators on the command line.

Every input a formula needs is a flag; a value that makes no sense is an argparse error (exit 2)
naming the flag. Tables by default (GiB), `--json` for machines (bytes, FLOPs and seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from engine.planning.activations import ATTENTION_KERNELS, RECOMPUTE
from engine.planning.flops import FLOPS_METHODS
from engine.planning.layout import Layout, PlanError, check_model_parallel
from engine.planning.memory import OFFLOADS, OPTIMIZERS, PRECISIONS, ZERO_STAGES
from engine.planning.presets import PRESETS
from engine.planning.report import search_table, serve_table, train_table
from engine.planning.search import search_plans
from engine.planning.serving import plan_serving
from engine.planning.spec import ModelSpec
from engine.planning.training import Throughput, plan_training
from engine.planning.units import GiB, dtype_bytes

SERVE_DTYPES = ("bfloat16", "float16", "float32")
# Settings whose flag is not just the setting's name with dashes.
FLAGS = {"gpu_memory": "--gpu-memory-gib"}


def _number(kind: str, ok, convert):
    def parse(text: str):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}")
        return convert(value)

    return parse


# Counts accept 1.5e11; sizes and rates are floats.
positive_int = _number("a positive integer", lambda v: v > 0 and v.is_integer(), int)
positive_float = _number("a positive number", lambda v: v > 0, float)
fraction = _number("a fraction in (0, 1]", lambda v: 0 < v <= 1, float)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model: a preset or config.json, or dimensions (--arch and below: dimensions only)")
    g.add_argument("--model", help=f"preset ({', '.join(PRESETS)}) or a config.json / model folder")
    g.add_argument("--layers", type=positive_int)
    g.add_argument("--hidden", type=positive_int)
    g.add_argument("--heads", type=positive_int)
    g.add_argument("--kv-heads", type=positive_int, help="default: --heads")
    g.add_argument("--head-dim", type=positive_int, help="default: hidden / heads")
    g.add_argument("--ffn-hidden", type=positive_int, help="default: 8h/3 (llama), 4h (gpt)")
    g.add_argument("--vocab", type=positive_int)
    g.add_argument("--arch", choices=("llama", "gpt"), default="llama", help="llama: SwiGLU, RMSNorm, rotary; gpt: GELU, LayerNorm, biases, learned positions")
    g.add_argument("--tie-embeddings", action="store_true")
    g.add_argument("--max-positions", type=positive_int, default=2048)
    g.add_argument("--params", type=positive_int, help="a published total that overrides the computed count")


def add_throughput_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speed (FLOP/s per GPU on the FLOPs counted, recomputation included)")
    g.add_argument("--achieved-tflops", type=positive_float)
    g.add_argument("--peak-tflops", type=positive_float)
    g.add_argument("--mfu", type=fraction, help="fraction of --peak-tflops achieved")
    g.add_argument("--flops", choices=FLOPS_METHODS, default="nd", help="nd: 6ND (8ND with full recompute); exact: per-layer count")


def add_training_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=positive_int, required=True)
    p.add_argument("--dtype", choices=PRECISIONS, default="mixed", help="mixed: 16-bit weights and gradients, fp32 master copy")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--attention", choices=ATTENTION_KERNELS, default="flash", help="eager keeps the s x s softmax")
    p.add_argument("--nodes", type=positive_int, default=1)
    p.add_argument("--gpus-per-node", type=positive_int, default=1)
    p.add_argument("--gpu-memory-gib", type=positive_float)
    p.add_argument("--tokens", type=positive_int, help="training tokens in all")


def add_parser(subparsers) -> None:
    """Register `plan` and its commands on an argparse subparsers object (`engine plan ...`)."""
    add_commands(subparsers.add_parser("plan", help="estimate training and serving memory and time", description=__doc__))


def add_commands(plan: argparse.ArgumentParser) -> None:
    commands = plan.add_subparsers(dest="plan_command", required=True)

    train = commands.add_parser("train", help="memory per GPU and time of one training layout")
    add_model_flags(train)
    add_training_flags(train)
    train.add_argument("--micro-batch", type=positive_int, default=1)
    train.add_argument("--grad-accum", type=positive_int, default=1)
    train.add_argument("--tp", type=positive_int, default=1)
    train.add_argument("--pp", type=positive_int, default=1)
    train.add_argument("--sequence-parallel", action="store_true")
    train.add_argument("--zero", type=int, choices=ZERO_STAGES, default=0)
    train.add_argument("--offload", choices=OFFLOADS, default="none")
    train.add_argument("--recompute", choices=RECOMPUTE, default="none")
    train.add_argument("--samples", type=positive_int, help="samples per epoch")
    train.add_argument("--epochs", type=positive_int, help="passes over --samples (default 1)")
    train.add_argument("--time-per-step", type=positive_float, help="measured seconds per step; gives MFU with --peak-tflops")
    add_throughput_flags(train)
    train.add_argument("--json", action="store_true")
    train.set_defaults(func=run_train, parser=train)

    serve = commands.add_parser("serve", help="weights, KV cache per token and KV capacity of one replica")
    add_model_flags(serve)
    serve.add_argument("--tp", type=positive_int, default=1)
    serve.add_argument("--pp", type=positive_int, default=1)
    serve.add_argument("--dtype", choices=SERVE_DTYPES, default="bfloat16")
    serve.add_argument("--kv-dtype", choices=("auto", *SERVE_DTYPES, "fp8"), default="auto", help="auto: --dtype")
    serve.add_argument("--gpu-memory-gib", type=positive_float)
    serve.add_argument("--gpu-memory-utilization", type=fraction, default=0.90)
    serve.add_argument("--kv-cache-memory-gib", type=positive_float, help="fixed KV budget (the engine's CPU setting); replaces the GPU-derived one")
    serve.add_argument("--max-model-len", type=positive_int, help="default: the model's max positions")
    serve.add_argument("--block-size", type=positive_int, default=16)
    serve.add_argument("--max-num-batched-tokens", type=positive_int, default=2048, help="tokens of the largest forward (workspace)")
    serve.add_argument("--max-num-seqs", type=positive_int, default=256, help="sequences sampled at once (workspace)")
    serve.add_argument("--json", action="store_true")
    serve.set_defaults(func=run_serve, parser=serve)

    search = commands.add_parser("search", help="rank the training layouts of a cluster that fit")
    add_model_flags(search)
    add_training_flags(search)
    search.add_argument("--global-batch", type=positive_int, required=True)
    search.add_argument("--top", type=positive_int, default=10)
    add_throughput_flags(search)
    search.add_argument("--json", action="store_true")
    search.set_defaults(func=run_search, parser=search)


def model_spec(args: argparse.Namespace) -> ModelSpec:
    parser, dims = args.parser, ("layers", "hidden", "heads", "vocab")
    if args.model is not None:
        if any(getattr(args, d) is not None for d in (*dims, "kv_heads", "head_dim", "ffn_hidden")):
            parser.error("argument --model: give either --model or the dimensions, not both")
        if args.model in PRESETS:
            spec = ModelSpec.from_preset(args.model)
        elif Path(args.model).exists():
            spec = _or_error(parser, "--model", ModelSpec.from_hf_config, args.model)
        else:
            parser.error(f"argument --model: {args.model!r} is neither a preset ({', '.join(PRESETS)}) nor a config path")
    else:
        missing = [f"--{d}" for d in dims if getattr(args, d) is None]
        if missing:
            parser.error(f"argument --model: give --model, or the dimensions ({', '.join(missing)} missing)")
        if args.heads % (args.kv_heads or args.heads):
            parser.error(f"argument --kv-heads: {args.kv_heads} does not divide --heads {args.heads}")
        spec = _or_error(
            parser, "--arch", ModelSpec.from_dims, layers=args.layers, hidden=args.hidden, heads=args.heads,
            vocab=args.vocab, kv_heads=args.kv_heads, ffn_hidden=args.ffn_hidden, head_dim=args.head_dim,
            arch=args.arch, tie_embeddings=args.tie_embeddings, max_positions=args.max_positions,
        )
    return spec.with_params(args.params)


def _or_error(parser, flag, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        parser.error(f"argument {flag}: {e}")


def _plan_error(parser, e: PlanError):
    flag = FLAGS.get(e.setting, "--" + e.setting.replace("_", "-"))
    parser.error(f"argument {flag}: {e.message}")


def throughput(args: argparse.Namespace) -> Throughput:
    if args.mfu is not None and args.peak_tflops is None:
        args.parser.error("argument --mfu: needs --peak-tflops")
    if args.mfu is not None and args.achieved_tflops is not None:
        args.parser.error("argument --mfu: give --achieved-tflops or --peak-tflops with --mfu, not both")
    return Throughput(
        achieved=_tera(args.achieved_tflops), peak=_tera(args.peak_tflops), mfu=args.mfu,
        time_per_step=getattr(args, "time_per_step", None),
    )


def _tera(value: float | None) -> float | None:
    return None if value is None else value * 1e12


def gib_bytes(value: float | None) -> int | None:
    return None if value is None else int(value * GiB)


def emit(args: argparse.Namespace, payload: dict, table: str) -> int:
    print(json.dumps(payload, indent=2) if args.json else table)
    return 0


def run_train(args: argparse.Namespace) -> int:
    spec = model_spec(args)
    layout = Layout(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, tp=args.tp, pp=args.pp, micro_batch=args.micro_batch,
        grad_accum=args.grad_accum, sequence_parallel=args.sequence_parallel, zero=args.zero, offload=args.offload,
        recompute=args.recompute,
    )
    try:
        plan = plan_training(
            spec, layout, seq_len=args.seq_len, precision=args.dtype, optimizer=args.optimizer, attention=args.attention,
            tokens=args.tokens, samples=args.samples, epochs=args.epochs, flops_method=args.flops,
            throughput=throughput(args), gpu_memory_bytes=gib_bytes(args.gpu_memory_gib),
        )
    except PlanError as e:
        _plan_error(args.parser, e)
    return emit(args, {"model": spec.name, **plan.to_json()}, train_table(spec, plan, gib_bytes(args.gpu_memory_gib)))


def run_serve(args: argparse.Namespace) -> int:
    spec = model_spec(args)
    try:
        check_model_parallel(spec, args.tp, args.pp)
    except PlanError as e:
        _plan_error(args.parser, e)
    if args.kv_cache_memory_gib is None and args.gpu_memory_gib is None:
        args.parser.error("argument --gpu-memory-gib: give the GPU's memory, or a fixed --kv-cache-memory-gib")
    plan = plan_serving(
        spec, dtype_bytes=dtype_bytes(args.dtype),
        kv_dtype_bytes=dtype_bytes(args.dtype if args.kv_dtype == "auto" else args.kv_dtype),
        max_model_len=args.max_model_len or spec.max_position_embeddings, block_size=args.block_size,
        tp=args.tp, pp=args.pp, gpu_memory_bytes=gib_bytes(args.gpu_memory_gib),
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_bytes=gib_bytes(args.kv_cache_memory_gib),
        max_batched_tokens=args.max_num_batched_tokens, max_seqs=args.max_num_seqs,
    )
    return emit(args, {"model": spec.name, **asdict(plan)}, serve_table(spec, plan, args.block_size))


def run_search(args: argparse.Namespace) -> int:
    spec = model_spec(args)
    if args.gpu_memory_gib is None:
        args.parser.error("argument --gpu-memory-gib: plan search needs the memory of one GPU")
    if args.tokens is None:
        args.parser.error("argument --tokens: plan search needs the number of training tokens")
    try:
        result = search_plans(
            spec, nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_memory_bytes=gib_bytes(args.gpu_memory_gib),
            seq_len=args.seq_len, global_batch=args.global_batch, tokens=args.tokens, throughput=throughput(args),
            precision=args.dtype, optimizer=args.optimizer, attention=args.attention, flops_method=args.flops,
        )
    except PlanError as e:
        _plan_error(args.parser, e)
    payload = {
        "model": spec.name, "considered": result.considered, "fitting": len(result.plans),
        "plans": [plan.to_json() for plan in result.plans[: args.top]],
    }
    return emit(args, payload, search_table(spec, result, args.top))


def main(argv: list[str] | None = None) -> int:
    """`engine plan`: argv is what follows `plan` (`python -m engine.planning.cli train ...`)."""
    parser = argparse.ArgumentParser(prog="engine plan", description=__doc__)
    add_commands(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
