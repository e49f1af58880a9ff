"""Readable tables for `engine plan`: sizes in GiB, counts with separators, times in days and hours."""

from __future__ import annotations

from engine.planning.search import SearchResult
from engine.planning.serving import ServePlan
from engine.planning.spec import ModelSpec
from engine.planning.training import TrainPlan
from engine.planning.units import GiB


def gib(nbytes: float) -> str:
    return f"{nbytes / GiB:,.2f} GiB"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "- (give --achieved-tflops, --peak-tflops with --mfu, or --time-per-step)"
    return f"{seconds / 86400:,.2f} days ({seconds / 3600:,.1f} h)"


def rows(pairs: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in pairs)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in pairs)


def model_line(spec: ModelSpec) -> str:
    return (
        f"model {spec.name}: {spec.params / 1e9:,.2f} B parameters, {spec.num_layers} layers, "
        f"hidden {spec.hidden_size}, {spec.num_heads} heads ({spec.num_kv_heads} KV, head_dim {spec.head_dim}), "
        f"ffn {spec.ffn_hidden_size}, vocab {spec.vocab_size}"
    )


def layout_line(plan: TrainPlan) -> str:
    lay = plan.layout
    return (
        f"{lay.gpus} GPUs ({lay.nodes} x {lay.gpus_per_node}): TP {lay.tp}, PP {lay.pp}, DP {lay.dp}, ZeRO {lay.zero}, "
        f"SP {'on' if lay.sequence_parallel else 'off'}, recompute {lay.recompute}, offload {lay.offload}, "
        f"micro-batch {lay.micro_batch} x grad-accum {lay.grad_accum}"
    )


def train_table(spec: ModelSpec, plan: TrainPlan, gpu_memory_bytes: int | None) -> str:
    mem = plan.memory_per_gpu
    fits = "-" if plan.fits is None else f"{'yes' if plan.fits else 'NO'} (in {gib(gpu_memory_bytes)})"
    return "\n".join([
        model_line(spec),
        layout_line(plan),
        "",
        rows([
            ("global batch", f"{plan.global_batch:,} samples"),
            ("steps", f"{plan.steps:,}"),
            ("tokens", f"{plan.tokens:,.4g}"),
            ("FLOPs", f"{plan.flops:.4g} (model FLOPs {plan.model_flops:.4g})"),
            ("time", duration(plan.time_s)),
            ("MFU", "-" if plan.mfu is None else f"{plan.mfu:.1%}"),
        ]),
        "",
        "memory per GPU",
        rows([
            ("  weights", gib(mem.weights)),
            ("  gradients", gib(mem.gradients)),
            ("  optimizer", gib(mem.optimizer)),
            ("  activations", f"{gib(mem.activations)}  ({gib(plan.activations_per_layer)} per layer and micro-batch)"),
            ("  total", gib(mem.total)),
            ("CPU memory per node", gib(plan.cpu_memory)),
            ("fits", fits),
        ]),
    ])


def serve_table(spec: ModelSpec, plan: ServePlan, block_size: int) -> str:
    return "\n".join([
        model_line(spec),
        "",
        rows([
            ("weights per GPU", gib(plan.weights_per_gpu)),
            ("forward workspace (estimate)", gib(plan.workspace_bytes)),
            ("KV cache budget", gib(plan.kv_budget_bytes)),
            ("KV cache per token", f"{plan.kv_bytes_per_token:,} bytes"),
            ("KV capacity", f"{plan.kv_capacity_tokens:,} tokens ({plan.num_kv_blocks:,} blocks of {block_size})"),
            (f"sequences of {plan.max_model_len:,} tokens", f"{plan.max_seqs_at_max_len:,}"),
            ("fits", "yes" if plan.fits else "NO: not one sequence of max-model-len fits"),
        ]),
    ])


def search_table(spec: ModelSpec, result: SearchResult, top: int) -> str:
    header = ["#", "TP", "PP", "DP", "ZeRO", "SP", "recompute", "micro", "accum", "weights", "grads", "optim", "acts",
              "total GiB", "days"]
    lines = [header]
    for rank, plan in enumerate(result.plans[:top], 1):
        lay, mem = plan.layout, plan.memory_per_gpu
        days = "-" if plan.time_s is None else f"{plan.time_s / 86400:,.2f}"
        lines.append([
            str(rank), str(lay.tp), str(lay.pp), str(lay.dp), str(lay.zero), "on" if lay.sequence_parallel else "off",
            lay.recompute, str(lay.micro_batch), str(lay.grad_accum),
            *(f"{b / GiB:.2f}" for b in (mem.weights, mem.gradients, mem.optimizer, mem.activations, mem.total)), days,
        ])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    table = "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines)
    summary = (f"{len(result.plans):,} of {result.considered:,} layouts fit; "
               f"best {min(top, len(result.plans))} by estimated time")
    return "\n".join([model_line(spec), summary, "", table])
