"""`engine plan train | serve | search`: the estimators on the command line.

Every input a formula needs is a flag; a value that makes no sense is an argparse error (exit 2)
naming the flag. Tables by default (GiB), `--json` for machines (bytes, FLOPs and seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from engine.arg_utils import ArgumentParser, add_engine_arg, add_log_level, walk_parsers
from engine.config import BLOCK_SIZES, canonical_dtype, hub_id
from engine.loading.hub import resolve_config_dir
from engine.planning.activations import ATTENTION_KERNELS, RECOMPUTE
from engine.planning.argtypes import bandwidth, fraction, positive_bytes, positive_float, positive_int, share
from engine.planning.flops import FLOPS_METHODS
from engine.planning.layout import Layout, PlanError, check_expert_parallel, check_model_parallel
from engine.planning.memory import OFFLOADS, OPTIMIZERS, PRECISIONS, ZERO_ACCOUNTING, ZERO_STAGES
from engine.planning.explain import explain_training
from engine.planning.hardware import GPU, GPUS, gpu_preset
from engine.planning.lora import BASE_QUANTIZATIONS, LORA_TARGETS, MAX_LORA_RANK, LoraSpec, adapter_slot_bytes
from engine.planning.presets import PRESETS
from engine.planning.report import search_table, serve_table, train_table
from engine.planning.search import search_plans
from engine.planning.slo_cli import add_slo_flags, run_slo
from engine.planning.serving import cpu_head_copy, plan_serving, served_len
from engine.planning.spec import ModelSpec
from engine.planning.steptime import DEFAULT_COMPUTE_EFFICIENCY, DEFAULT_DP_OVERLAP, Throughput
from engine.planning.training import plan_training
from engine.planning.units import GiB, dtype_bytes
from engine.planning.weight_formats import gguf_type_arg, quantization_arg

SERVE_DTYPES = ("bfloat16", "float16", "float32")
KV_DTYPES = ("auto", *SERVE_DTYPES, "fp8")
# PlanError settings whose flag's dest is not the setting's own name.
DESTS = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size", "gpu_memory": "gpu_memory_gib"}
# --lora-targets spellings: the short names, PEFT's module names, and PEFT's "all-linear"
TARGET_NAMES = {**{t: (t,) for t in LORA_TARGETS}, **{f"{t}_proj": (t,) for t in LORA_TARGETS},
                "all-linear": ("all-linear",)}


class _GiBAlias(argparse.Action):
    """`--kv-cache-memory-gib 1.5`, the name before `--kv-cache-memory 1.5GiB`: still accepted."""

    def __call__(self, parser, namespace, value, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is deprecated: use --kv-cache-memory {value:g}GiB",
              file=sys.stderr)
        setattr(namespace, self.dest, int(value * GiB))


def add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model: a preset or config.json, or dimensions (--arch and below: dimensions only)")
    g.add_argument("--model", help=f"a preset ({', '.join(PRESETS)}) or a config.json / model folder; "
                                   "or give the dimensions below instead")
    g.add_argument("--layers", type=positive_int, help="transformer layers")
    g.add_argument("--hidden", type=positive_int, help="hidden size")
    g.add_argument("--heads", type=positive_int, help="attention heads")
    g.add_argument("--kv-heads", type=positive_int, help="key/value heads (default: --heads)")
    g.add_argument("--head-dim", type=positive_int, help="size of one head (default: hidden / heads)")
    g.add_argument("--ffn-hidden", type=positive_int, help="MLP hidden size (default: 8h/3 for llama, 4h for gpt)")
    g.add_argument("--vocab", type=positive_int, help="vocabulary size")
    g.add_argument("--arch", choices=("llama", "gpt"), default="llama",
                   help="llama: SwiGLU, RMSNorm, rotary; gpt: GELU, LayerNorm, biases, learned positions")
    g.add_argument("--tie-embeddings", action="store_true", help="the LM head shares the embedding matrix")
    g.add_argument("--max-positions", type=positive_int, default=2048, help="the model's context length")
    g.add_argument("--params", type=positive_int,
                   help="a published parameter count that overrides the computed one (default: computed)")


def add_hardware_flags(p: argparse.ArgumentParser, cpu: bool = False) -> argparse._ArgumentGroup:
    g = p.add_argument_group("hardware (--gpu sets every figure; each flag below overrides its own)")
    names = (*GPUS, "cpu") if cpu else tuple(GPUS)
    g.add_argument("--gpu", choices=names, metavar="NAME",
                   help=f"a GPU preset: {', '.join(GPUS)}" + ("; cpu: this machine, measured at start" if cpu else ""))
    g.add_argument("--peak-tflops", type=positive_float, help="the GPU's dense peak TFLOP/s at the training precision")
    g.add_argument("--hbm-tbps", type=positive_float, help="GPU memory bandwidth, TB/s")
    g.add_argument("--intra-node-gbps", type=bandwidth, help="GB/s per GPU per direction inside a node (NVLink...)")
    g.add_argument("--inter-node-gbps", type=bandwidth, help="GB/s per GPU per direction across nodes (its NIC)")
    g.add_argument("--price-per-gpu-hour", type=positive_float, help="USD per GPU-hour, for the cost")
    return g


def add_throughput_flags(p: argparse.ArgumentParser) -> None:
    add_hardware_flags(p)
    g = p.add_argument_group("speed: a published / measured rate (end to end), or predicted from the hardware")
    g.add_argument("--achieved-tflops", type=positive_float,
                   help="measured TFLOP/s per GPU on the FLOPs counted (recomputation included), end to end")
    g.add_argument("--mfu", type=fraction, help="measured model FLOPs utilization (of the peak), end to end")
    g.add_argument("--compute-efficiency", type=fraction, default=DEFAULT_COMPUTE_EFFICIENCY,
                   help="predicted time: the fraction of peak the matmuls reach")
    g.add_argument("--dp-overlap", type=share, default=DEFAULT_DP_OVERLAP,
                   help="predicted time: the share of the DP gradient sync hidden behind the backward pass")
    g.add_argument("--flops", choices=FLOPS_METHODS, default="nd",
                   help="nd: 6ND (8ND with full recompute); exact: per-layer count")
    g.add_argument("--explain", action="store_true", help="print each figure with its formula and source")


def add_training_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=positive_int, required=True, help="tokens per training sample")
    p.add_argument("--dtype", type=canonical_dtype, choices=PRECISIONS, default="mixed",
                   help="mixed: 16-bit weights and gradients, fp32 master copy; fp16/half, bf16, fp32/float "
                        "are accepted")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="adamw8bit: 1-byte states; adamw32bit: float32 states whatever --dtype (bitsandbytes' "
                        "paged_adamw_32bit, QLoRA's)")
    p.add_argument("--attention", choices=ATTENTION_KERNELS, default="flash", help="eager keeps the s x s softmax")
    p.add_argument("--nodes", type=positive_int, default=1, help="machines")
    p.add_argument("--gpus-per-node", type=positive_int, default=1, help="GPUs in each machine")
    p.add_argument("--gpu-memory-gib", type=positive_float, help="memory of one GPU in GiB, to check the fit "
                                                                 "(default: --gpu's)")
    p.add_argument("--tokens", type=positive_int, help="training tokens in all (or --samples with --epochs)")


def lora_targets(text: str) -> tuple[str, ...]:
    """`q,k,v,o,gate,up,down` (or q_proj,... or all-linear) as LoRA targets, in the model's order."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in TARGET_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or repr(text)} is not a LoRA target: give a comma list "
                                         f"of {', '.join(LORA_TARGETS)} (or q_proj, ... or all-linear); embeddings, "
                                         "the LM head and routed experts are not adapted")
    chosen = {t for n in names for t in TARGET_NAMES[n]}
    return ("all-linear",) if "all-linear" in chosen else tuple(t for t in LORA_TARGETS if t in chosen)


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA / QLoRA: train adapters only (PEFT's LoraConfig names)")
    g.add_argument("--lora-rank", "--lora-r", dest="lora_rank", type=positive_int, metavar="R",
                   help="LoRA's r: train adapters A (r x in) and B (out x r) on each targeted projection, the base "
                        "frozen (default: full fine-tuning)")
    g.add_argument("--lora-targets", "--lora-target-modules", dest="lora_targets", type=lora_targets,
                   metavar="LIST", help="projections to adapt: a comma list of q, k, v, o, gate, up, down (or q_proj, "
                                        "..., all-linear); default q,v, PEFT's for Llama")
    g.add_argument("--lora-alpha", type=positive_float, metavar="A",
                   help="scale alpha / r of the adapters' output (default 8, PEFT's); changes no memory")
    g.add_argument("--lora-dropout", type=share, metavar="P",
                   help="dropout on the adapters' input (default 0, PEFT's); above 0 each targeted projection keeps "
                        "a dropped copy of its input and a mask for the backward")
    g.add_argument("--base-quantization", choices=BASE_QUANTIZATIONS,
                   help="the frozen base's linear layers: nf4 (QLoRA, bitsandbytes' 4-bit NormalFloat), int8 "
                        "(LLM.int8) or none (--dtype, the default); embeddings, LM head and norms stay at --dtype")
    g.add_argument("--double-quant", action=argparse.BooleanOptionalAction,
                   help="nf4: store the blocks' absmax in 8 bits (4.127 bits a weight, QLoRA's default; "
                        "--no-double-quant: 4.5 bits)")


def lora_spec(args: argparse.Namespace, spec: ModelSpec) -> LoraSpec | None:
    """The LoRA setup of `plan train`'s flags, None for full fine-tuning; flags that need --lora-rank refused.
    all-linear is every projection the model has, as in PEFT."""
    given = [flag for flag, value in (("--lora-targets", args.lora_targets), ("--lora-alpha", args.lora_alpha),
                                      ("--lora-dropout", args.lora_dropout),
                                      ("--base-quantization", args.base_quantization),
                                      ("--double-quant", args.double_quant)) if value is not None]
    if args.lora_rank is None:
        if given:
            args.parser.error(f"argument {given[0]}: give --lora-rank too (LoRA's r), or drop {given[0]} for full "
                              "fine-tuning")
        return None
    quantization = args.base_quantization or "none"
    if args.double_quant is not None and quantization != "nf4":
        args.parser.error("argument --double-quant/--no-double-quant: applies to --base-quantization nf4 only")
    if args.lora_dropout is not None and args.lora_dropout >= 1:
        args.parser.error(f"argument --lora-dropout: must be below 1, got {args.lora_dropout:g}")
    chosen = {"target_modules": args.lora_targets, "lora_alpha": args.lora_alpha, "lora_dropout": args.lora_dropout,
              "double_quant": args.double_quant}
    if args.lora_targets == ("all-linear",):
        chosen["target_modules"] = tuple(dict.fromkeys(p.target for p in spec.projections()))
    return LoraSpec(r=args.lora_rank, base_quantization=quantization,
                    **{field: value for field, value in chosen.items() if value is not None})


def add_zero_accounting_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--zero-accounting", choices=ZERO_ACCOUNTING, default="paper",
                   help="paper: ZeRO's Figure 1; deepspeed: what DeepSpeed's runtime holds (its estimators: an fp32 "
                        "gradient partition, ZeRO-3's live module)")


def add_parallel_flags(p: argparse.ArgumentParser, ep_help: str, ep_flags=("--expert-parallel-size", "-ep", "--ep")):
    """The engine's own flags (`--tensor-parallel-size/-tp`, ...), with plan's older --tp/--pp."""
    add_engine_arg(p, "tensor_parallel_size", type=positive_int)
    add_engine_arg(p, "pipeline_parallel_size", type=positive_int)
    p.add_argument(*ep_flags, dest="ep", type=positive_int, default=1, help=ep_help)


def add_weight_format_flags(g) -> None:
    g.add_argument("--quantization", "-q", type=quantization_arg, metavar="METHOD",
                   help="linear layers quantized at load: int8 (stored as Q8_0 blocks, 8.5 bits a weight with its "
                        "scales) or int4 (Q4_1 blocks, 5.0 bits, groups of 32 or 128), as `engine serve "
                        "--quantization`; fp8 (e4m3 blocks of 32 with the tensor's float32 scale, 9.0 bits; vLLM's own "
                        "layout is 8 bits and one scale per tensor)")
    g.add_argument("--weight-format", type=gguf_type_arg, metavar="TYPE",
                   help="linear layers in a GGUF file's block type: Q8_0 (8.5 bits), Q4_0 (4.5), Q4_1 (5.0), "
                        "Q4_K (4.5), Q6_K (6.5625); embeddings, LM head and norms at --dtype (the engine holds a GGUF "
                        "file's embedding and LM head blocks as stored: such a file's own size is its weights)")
    add_engine_arg(g, "quantize_lm_head")


def add_parser(subparsers) -> None:
    """Register `plan` and its commands on an argparse subparsers object (`engine plan ...`)."""
    add_commands(subparsers.add_parser("plan", help="estimate training and serving memory and time",
                                       description=__doc__))


def add_commands(plan: argparse.ArgumentParser) -> None:
    commands = plan.add_subparsers(dest="plan_command", required=True)

    train = commands.add_parser("train", help="memory per GPU and time of one training layout", description=__doc__)
    add_model_flags(train)
    add_training_flags(train)
    train.add_argument("--micro-batch", type=positive_int, default=1, help="samples per GPU per forward")
    train.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    add_parallel_flags(train, "MoE: expert-parallel ranks, carved out of the data-parallel ones; each holds "
                              "experts / ep of the experts (each still split over TP)")
    train.add_argument("--sequence-parallel", action="store_true",
                       help="split the norms' and dropouts' activations over the TP ranks too")
    train.add_argument("--zero", type=int, choices=ZERO_STAGES, default=0,
                       help="ZeRO stage: 1 shards optimizer states, 2 gradients too, 3 parameters too")
    add_zero_accounting_flag(train)
    train.add_argument("--offload", choices=OFFLOADS, default="none", help="keep these in CPU memory (ZeRO-Offload)")
    train.add_argument("--recompute", choices=RECOMPUTE, default="none",
                       help="activation recomputation: selective (attention) or full (every layer)")
    train.add_argument("--samples", type=positive_int, help="samples per epoch")
    train.add_argument("--epochs", type=positive_int, help="passes over --samples (default: 1)")
    train.add_argument("--time-per-step", type=positive_float,
                       help="measured seconds per step; gives MFU with --peak-tflops")
    add_lora_flags(train)
    add_throughput_flags(train)
    train.add_argument("--json", action="store_true", help="print JSON (bytes, FLOPs, seconds) instead of a table")
    train.set_defaults(func=run_train, parser=train)

    serve = commands.add_parser("serve", help="weights, KV cache per token and KV capacity of one replica",
                                description=__doc__)
    add_model_flags(serve)
    g = serve.add_argument_group("engine settings (the same flags as `engine serve`)")
    add_engine_arg(g, "enable_expert_parallel",
                   help="MoE, as `engine serve --enable-expert-parallel` runs it: the TP ranks hold whole experts, "
                        "experts / TP each (EP size = TP); their outputs are summed by the TP all-reduce, no "
                        "all-to-all")
    # Not vLLM's `-ep`, which is its --enable-expert-parallel switch: here a width, as SGLang's --ep-size.
    add_parallel_flags(g, "MoE, vLLM's layout (not this engine's): the experts spread whole over N GPUs, N = DP x TP "
                          "(vLLM --enable-expert-parallel --data-parallel-size N/TP; SGLang --ep-size N), attention "
                          "data-parallel, tokens moved by all-to-all; the memory of one of those GPUs",
                       ep_flags=("--expert-parallel-size", "--ep"))
    add_weight_format_flags(g)
    add_engine_arg(g, "dtype", choices=("auto", *SERVE_DTYPES), default="bfloat16",
                   help="weights and activations; half/fp16 = float16, bf16 = bfloat16, float/fp32 = float32; "
                        "auto: bfloat16, as the engine picks on CUDA")
    add_engine_arg(g, "kv_cache_dtype", aliases=("--kv-dtype",), choices=KV_DTYPES,
                   help="KV cache elements, same names as --dtype, and fp8; auto: the same as --dtype")
    g.add_argument("--gpu-memory-gib", type=positive_float, help="memory of one GPU in GiB")
    add_engine_arg(g, "gpu_memory_utilization", type=fraction)
    add_engine_arg(g, "kv_cache_memory", type=positive_bytes, default=None,
                   help="a fixed KV cache budget (the engine's CPU setting), bytes or with a unit (1.5GiB); "
                        "replaces the budget left on the GPU (default: derived from --gpu-memory-gib)")
    g.add_argument("--kv-cache-memory-gib", dest="kv_cache_memory", type=positive_float, action=_GiBAlias,
                   default=argparse.SUPPRESS, metavar="GIB", help="deprecated: --kv-cache-memory with a unit")
    add_engine_arg(g, "max_model_len", type=positive_int,
                   help="context window in tokens (default: the model's max positions)")
    add_engine_arg(g, "block_size", type=int, choices=BLOCK_SIZES)
    add_engine_arg(g, "max_num_batched_tokens", type=positive_int,
                   help="token budget of one engine step: sizes the forward's workspace")
    add_engine_arg(g, "max_num_seqs", type=positive_int,
                   help="most sequences running at once: sizes the sampler's workspace")
    lora = serve.add_argument_group("LoRA adapters (vLLM's names)")
    lora.add_argument("--max-loras", type=positive_int, metavar="N",
                      help="adapter slots held on the GPU: each holds A and B at --max-lora-rank for every projection "
                           "of every layer in --dtype, memory taken from the KV cache (default: no LoRA)")
    lora.add_argument("--max-lora-rank", type=positive_int, metavar="R",
                      help=f"the rank each slot is sized for (default {MAX_LORA_RANK}, vLLM's); needs --max-loras")
    add_hardware_flags(serve, cpu=True)
    add_slo_flags(serve)
    serve.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")
    serve.set_defaults(func=run_serve, parser=serve)

    search = commands.add_parser("search", help="rank the training layouts of a cluster that fit", description=__doc__)
    add_model_flags(search)
    add_training_flags(search)
    search.add_argument("--global-batch", type=positive_int, required=True, help="samples per optimizer step")
    add_zero_accounting_flag(search)
    search.add_argument("--top", type=positive_int, default=10, help="how many of the fitting layouts to print")
    add_throughput_flags(search)
    search.add_argument("--json", action="store_true", help="print JSON instead of a table")
    search.set_defaults(func=run_search, parser=search)


def model_spec(args: argparse.Namespace) -> ModelSpec:
    parser, dims = args.parser, ("layers", "hidden", "heads", "vocab")
    if args.model is not None:
        if any(getattr(args, d) is not None for d in (*dims, "kv_heads", "head_dim", "ffn_hidden")):
            parser.error("argument --model: give either --model or the dimensions, not both")
        if args.model in PRESETS:
            spec = ModelSpec.from_preset(args.model)
        elif Path(args.model).exists() or hub_id(args.model) is not None:
            # A Hub id is read from the local Hugging Face cache (its config.json alone is fetched when missing).
            spec = _or_error(parser, "--model", lambda m: ModelSpec.from_hf_config(resolve_config_dir(m)), args.model)
        else:
            parser.error(f"argument --model: {args.model!r} is neither a preset ({', '.join(PRESETS)}), "
                         f"a config path nor a Hub id (ORG/NAME)")
    else:
        missing = [f"--{d}" for d in dims if getattr(args, d) is None]
        if missing:
            parser.error(f"argument --model: give --model, or the dimensions ({', '.join(missing)} missing)")
        if args.heads % (args.kv_heads or args.heads):
            parser.error(f"argument --kv-heads: {args.kv_heads} does not divide --heads {args.heads}")
        if args.head_dim is None and args.hidden % args.heads:  # the head size would be floored in silence
            parser.error(f"argument --heads: {args.heads} does not divide --hidden {args.hidden}: give --head-dim")
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
    dest = DESTS.get(e.setting, e.setting)
    # Named as argparse names a flag in its own errors: every spelling, e.g. --tensor-parallel-size/-tp/--tp.
    flag = next(("/".join(a.option_strings) for a in parser._actions if a.dest == dest and a.option_strings),
                "--" + e.setting.replace("_", "-"))
    parser.error(f"argument {flag}: {e.message}")


def hardware(args: argparse.Namespace) -> GPU | None:
    """The --gpu preset with every figure given by its own flag put in; None without --gpu."""
    if args.gpu is None:
        return None
    return gpu_preset(args.gpu).with_overrides(
        memory_gib=args.gpu_memory_gib, hbm_tbps=args.hbm_tbps, intra_node_gbps=args.intra_node_gbps,
        inter_node_gbps=args.inter_node_gbps, price_per_gpu_hour=args.price_per_gpu_hour)


def resolve_hardware(args: argparse.Namespace) -> None:
    """Fill the figures a --gpu preset knows into the flags not given, so one value reaches every formula."""
    gpu = None if args.gpu == "cpu" else hardware(args)
    if gpu is None:
        return
    precision = getattr(args, "dtype", "mixed")
    args.peak_tflops = args.peak_tflops or gpu.peak_tflops(precision)
    args.gpu_memory_gib, args.hbm_tbps = gpu.memory_gib, gpu.hbm_tbps
    args.intra_node_gbps, args.inter_node_gbps = gpu.intra_node_gbps, gpu.inter_node_gbps
    args.price_per_gpu_hour = gpu.price_per_gpu_hour


def throughput(args: argparse.Namespace) -> Throughput:
    if args.mfu is not None and args.peak_tflops is None:
        args.parser.error("argument --mfu: needs --peak-tflops or --gpu")
    if args.mfu is not None and args.achieved_tflops is not None:
        args.parser.error("argument --mfu: give --achieved-tflops or --peak-tflops with --mfu, not both")
    return Throughput(
        achieved=_tera(args.achieved_tflops), peak=_tera(args.peak_tflops), mfu=args.mfu,
        time_per_step=getattr(args, "time_per_step", None), intra_node_bw=_giga(args.intra_node_gbps),
        inter_node_bw=_giga(args.inter_node_gbps), compute_efficiency=args.compute_efficiency,
        dp_overlap=args.dp_overlap,
    )


def _giga(value: float | None) -> float | None:
    return None if value is None else value * 1e9


def _tera(value: float | None) -> float | None:
    return None if value is None else value * 1e12


def gib_bytes(value: float | None) -> int | None:
    return None if value is None else int(value * GiB)


def emit(args: argparse.Namespace, payload: dict, table: str) -> int:
    print(json.dumps(payload, indent=2) if args.json else table)
    return 0


def run_train(args: argparse.Namespace) -> int:
    spec = model_spec(args)
    resolve_hardware(args)
    layout = Layout(
        nodes=args.nodes, gpus_per_node=args.gpus_per_node, tp=args.tensor_parallel_size,
        pp=args.pipeline_parallel_size, micro_batch=args.micro_batch,
        grad_accum=args.grad_accum, sequence_parallel=args.sequence_parallel, zero=args.zero, offload=args.offload,
        recompute=args.recompute, ep=args.ep,
    )
    try:
        plan = plan_training(
            spec, layout, seq_len=args.seq_len, precision=args.dtype, optimizer=args.optimizer,
            attention=args.attention, tokens=args.tokens, samples=args.samples, epochs=args.epochs,
            flops_method=args.flops, throughput=throughput(args), gpu_memory_bytes=gib_bytes(args.gpu_memory_gib),
            price_per_gpu_hour=args.price_per_gpu_hour, zero_accounting=args.zero_accounting,
            lora=lora_spec(args, spec),
        )
    except PlanError as e:
        _plan_error(args.parser, e)
    table = train_table(spec, plan, gib_bytes(args.gpu_memory_gib))
    if args.explain:
        table += "\n\n" + explain_training(spec, plan, args.dtype, args.seq_len, args.flops, args.optimizer)
    return emit(args, {"model": spec.name, **plan.to_json()}, table)


def serving_weights(args: argparse.Namespace):
    """The linear layers' WeightFormat from --quantization or --weight-format (None: --dtype), with
    --quantize-lm-head the LM head's too."""
    if args.quantization is not None and args.weight_format is not None:
        args.parser.error("argument --weight-format: give --quantization (quantized at load) or --weight-format "
                          "(a GGUF file's blocks), not both")
    if args.quantize_lm_head:
        if args.quantization is None:
            args.parser.error("argument --quantize-lm-head: give --quantization int8, int4 or fp8 too (the engine "
                              "quantizes the head at load with them), or drop --quantize-lm-head")
        return replace(args.quantization, lm_head=True)
    return args.quantization or args.weight_format


def expert_layout(args: argparse.Namespace, spec: ModelSpec) -> tuple[int, str]:
    """(EP size, layout): the engine's --enable-expert-parallel (EP = TP) or vLLM's --expert-parallel-size."""
    tp, ep = args.tensor_parallel_size, args.ep
    if args.enable_expert_parallel and ep > 1:
        args.parser.error("argument --expert-parallel-size/--ep: give --enable-expert-parallel (the engine's layout, "
                          "EP = TP) or --expert-parallel-size (vLLM's, EP = DP x TP), not both")
    if args.enable_expert_parallel:
        if not spec.is_moe:
            _plan_error(args.parser, PlanError("enable_expert_parallel", f"{spec.name} is a dense model: no experts "
                                                                         "to spread"))
        if spec.num_experts % tp:  # the engine's MoeConfig.shard_problem
            _plan_error(args.parser, PlanError("tp", f"expert parallelism over {tp} TP ranks needs the number of "
                                                     f"experts ({spec.num_experts}) to be a multiple of it"))
        return tp, "engine"
    if ep > 1 and ep % tp:
        _plan_error(args.parser, PlanError("ep", f"{ep} is not a multiple of the tensor-parallel size {tp}: vLLM's "
                                                 f"EP group is DP x TP ranks"))
    return ep, "vllm"


def run_serve(args: argparse.Namespace) -> int:
    spec = model_spec(args)
    resolve_hardware(args)
    args.weights = serving_weights(args)
    if args.max_lora_rank is not None and args.max_loras is None:
        args.parser.error("argument --max-lora-rank: give --max-loras too (the number of adapter slots)")
    if args.max_loras and (args.slo or args.concurrency):
        args.parser.error("argument --max-loras: --slo plans without adapter slots; drop one of them")
    if args.slo or args.concurrency:
        if args.ep > 1:
            args.parser.error("argument --expert-parallel-size/--ep: --slo plans this engine's layouts "
                              "(replicas x TP); vLLM's expert parallelism is not one of them")
        return run_slo(args, spec)
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    try:
        check_model_parallel(spec, tp, pp)
        ep, ep_layout = expert_layout(args, spec)
        check_expert_parallel(spec, ep, expert_tp=1 if ep > 1 else tp)
    except PlanError as e:
        _plan_error(args.parser, e)
    if args.kv_cache_memory is None and args.gpu_memory_gib is None:
        args.parser.error("argument --gpu-memory-gib: give the GPU's memory, or a fixed --kv-cache-memory")
    try:
        max_model_len, windowed = served_len(spec, args.max_model_len)
    except PlanError as e:
        _plan_error(args.parser, e)
    if windowed:
        print(f"{args.parser.prog}: note: max_model_len limited to the model's sliding window ({max_model_len} "
              "tokens), as the engine limits it", file=sys.stderr)
    dtype = "bfloat16" if args.dtype == "auto" else args.dtype
    slots = 0 if args.max_loras is None else adapter_slot_bytes(
        spec, args.max_loras, args.max_lora_rank or MAX_LORA_RANK, dtype_bytes(dtype), tp, pp)
    plan = plan_serving(
        spec, dtype_bytes=dtype_bytes(dtype),
        kv_dtype_bytes=dtype_bytes(dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype),
        max_model_len=max_model_len, block_size=args.block_size,
        tp=tp, pp=pp, gpu_memory_bytes=gib_bytes(args.gpu_memory_gib),
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_bytes=args.kv_cache_memory,
        max_batched_tokens=args.max_num_batched_tokens, max_seqs=args.max_num_seqs, ep=ep, ep_layout=ep_layout,
        weight_format=args.weights, dtype_name=dtype, lora_slot_bytes=slots,
        head_copy=args.gpu == "cpu" and cpu_head_copy(
            spec, dtype, args.weight_format is not None or (args.weights is not None and args.weights.lm_head)),
    )
    return emit(args, {"model": spec.name, **asdict(plan)}, serve_table(spec, plan, args.block_size))


def run_search(args: argparse.Namespace) -> int:
    spec = model_spec(args)
    resolve_hardware(args)
    if args.gpu_memory_gib is None:
        args.parser.error("argument --gpu-memory-gib: plan search needs the memory of one GPU")
    if args.tokens is None:
        args.parser.error("argument --tokens: plan search needs the number of training tokens")
    try:
        result = search_plans(
            spec, nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_memory_bytes=gib_bytes(args.gpu_memory_gib),
            seq_len=args.seq_len, global_batch=args.global_batch, tokens=args.tokens, throughput=throughput(args),
            precision=args.dtype, optimizer=args.optimizer, attention=args.attention, flops_method=args.flops,
            zero_accounting=args.zero_accounting, price_per_gpu_hour=args.price_per_gpu_hour,
        )
    except PlanError as e:
        _plan_error(args.parser, e)
    payload = {
        "model": spec.name, "considered": result.considered, "fitting": len(result.plans), "excluded": result.excluded,
        "plans": [plan.to_json() for plan in result.plans[: args.top]],
    }
    return emit(args, payload, search_table(spec, result, args.top))


def main(argv: list[str] | None = None) -> int:
    """`engine plan`: argv is what follows `plan` (`python -m engine.planning.cli train ...`)."""
    parser = ArgumentParser(prog="engine plan", description=__doc__)
    add_log_level(parser)  # accepted for the same command line as the rest of `engine`; plan logs nothing
    add_commands(parser)
    for _, sub in list(walk_parsers(parser))[1:]:
        add_log_level(sub, top=False)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
