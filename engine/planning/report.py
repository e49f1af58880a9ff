"""Readable tables for `engine plan`: sizes in GiB, counts with separators, times in days and hours."""

from __future__ import annotations

from engine.planning.search import SearchResult
from engine.planning.serving import ServePlan
from engine.planning.spec import ModelSpec
from engine.planning.training import TrainPlan
from engine.planning.units import GiB
from engine.planning.weight_formats import FORMATS


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
    line = (
        f"model {spec.name}: {spec.params / 1e9:,.2f} B parameters, {spec.num_layers} layers, "
        f"hidden {spec.hidden_size}, {spec.num_heads} heads ({spec.num_kv_heads} KV, head_dim {spec.head_dim}), "
        f"ffn {spec.ffn_hidden_size}, vocab {spec.vocab_size}"
    )
    if spec.is_moe:
        shared = f" + a shared expert of {spec.shared_expert_ffn_size}" if spec.shared_expert_ffn_size else ""
        line += (f"\n  mixture of experts: {spec.active_params / 1e9:,.2f} B active per token; "
                 f"{len(spec.moe_layers)} MoE layers of {spec.num_experts} experts of {spec.expert_ffn_size}, "
                 f"top {spec.experts_per_token}{shared}")
    return line


def layout_line(plan: TrainPlan) -> str:
    lay = plan.layout
    return (
        f"{lay.gpus} GPUs ({lay.nodes} x {lay.gpus_per_node}): TP {lay.tp}, PP {lay.pp}, DP {lay.dp}, ZeRO {lay.zero}, "
        f"SP {'on' if lay.sequence_parallel else 'off'}, recompute {lay.recompute}, offload {lay.offload}, "
        f"micro-batch {lay.micro_batch} x grad-accum {lay.grad_accum}" + (f", EP {lay.ep}" if lay.ep > 1 else "")
    )


def chinchilla_hint(plan: TrainPlan) -> str:
    """Far (over 2x) from ~20 tokens per parameter (Hoffmann et al. 2022): say so, as a hint (pre-training's:
    not for adapters)."""
    ratio = plan.tokens / plan.chinchilla_tokens
    if 0.5 <= ratio <= 2 or plan.lora is not None:
        return ""
    return (f"  ({plan.tokens / plan.params:,.1f} tokens per parameter; compute-optimal is about 20, "
            f"{plan.chinchilla_tokens:,.3g} tokens: Hoffmann et al. 2022)")


def step_rows(plan: TrainPlan) -> list[tuple[str, str]]:
    step = plan.step
    if step is None:
        return []
    if step.end_to_end:
        return [("step time", f"{step.total:,.3f} s (end to end, as given)")]
    return [("step time", f"{step.total:,.3f} s = compute {step.compute:,.3f} + exposed communication "
                          f"{step.exposed_communication:,.3f} + bubble {step.bubble:,.3f} (predicted)")]


def comm_rows(plan: TrainPlan) -> list[str]:
    if not plan.communication:
        return []
    out = ["", "communication per GPU per optimizer step"]
    for c in plan.communication:
        secs = "" if c["seconds"] is None else f", {c['seconds']:,.3f} s"
        link = "across nodes" if c["crosses_nodes"] else "inside a node"
        out.append(f"  {c['name']:<28} {gib(c['bytes'])} over {c['ranks']} ranks {link}{secs}"
                   f"{' (overlaps the backward)' if c['overlapped'] else ''}")
    return out


def lora_rows(plan: TrainPlan) -> list[tuple[str, str]]:
    lora = plan.lora
    if lora is None:
        return []
    return [("trainable parameters", f"{plan.trainable_params:,} ({plan.trainable_params / plan.params:.3%}): LoRA "
                                     f"r {lora['r']}, alpha {lora['lora_alpha']:g} (scale {lora['scaling']:g}) on "
                                     f"{', '.join(lora['target_modules'])}, the base frozen")]


def weights_row(plan: TrainPlan) -> str:
    mem, lora = plan.memory_per_gpu, plan.lora
    if lora is None or not lora["frozen_weights_per_gpu"]:
        return gib(mem.weights)
    frozen = lora["frozen_weights_per_gpu"]
    return (f"{gib(mem.weights)}  (frozen base {gib(frozen)}, linear layers in {lora['base_storage']}; "
            f"adapters {gib(mem.weights - frozen)})")


def train_table(spec: ModelSpec, plan: TrainPlan, gpu_memory_bytes: int | None) -> str:
    mem = plan.memory_per_gpu
    fits = "-" if plan.fits is None else f"{'yes' if plan.fits else 'NO'} (in {gib(gpu_memory_bytes)})"
    return "\n".join([
        model_line(spec),
        layout_line(plan),
        "",
        rows([
            *lora_rows(plan),
            ("global batch", f"{plan.global_batch:,} samples ({plan.tokens_per_step:,} tokens) per optimizer step"),
            ("micro-batches per step", f"{plan.layout.grad_accum:,} on each of {plan.layout.dp:,} DP replicas"),
            ("optimizer steps", f"{plan.steps:,}"),
            ("micro-steps", f"{plan.micro_steps:,} (forward + backward passes of each GPU)"),
            ("tokens", f"{plan.tokens:,.4g}{chinchilla_hint(plan)}"),
            ("FLOPs", f"{plan.flops:.4g} (model FLOPs {plan.model_flops:.4g})"),
            *step_rows(plan),
            ("time", duration(plan.time_s)),
            ("MFU / HFU", "-" if plan.mfu is None else f"{plan.mfu:.1%} / {plan.hfu:.1%}"),
            ("GPU-hours", "-" if plan.gpu_hours is None else f"{plan.gpu_hours:,.0f}"),
            ("cost", "-" if plan.cost is None else f"${plan.cost:,.0f} (at the price per GPU-hour given)"),
        ]),
        *comm_rows(plan),
        "",
        "memory per GPU",
        rows([
            ("  weights", weights_row(plan)),
            ("  gradients", gib(mem.gradients)),
            ("  optimizer", gib(mem.optimizer)),
            ("  activations", f"{gib(mem.activations)}  ({gib(plan.activations_per_layer)} per layer and micro-batch)"),
            ("  total", gib(mem.total)),
            ("CPU memory per node", gib(plan.cpu_memory)),
            ("fits", fits),
        ]),
    ])


EP_ROWS = {"engine": "{per} whole experts of {experts} on each of the {ep} TP ranks (the engine's "
                     "--enable-expert-parallel: EP = TP, no all-to-all)",
           "vllm": "{per} whole experts of {experts} on each of {ep} GPUs (vLLM's expert parallelism, EP = DP x TP: "
                   "not a layout of this engine)"}


def serve_table(spec: ModelSpec, plan: ServePlan, block_size: int) -> str:
    return "\n".join([
        model_line(spec),
        "",
        rows([
            ("weights per GPU", f"{gib(plan.weights_per_gpu)}  (linear layers in {plan.weight_format}"
                                + (f", LM head in {FORMATS[plan.weight_format].head_as}" if plan.quantize_lm_head
                                   else "") + ")"),
            *([("experts", EP_ROWS[plan.expert_parallel].format(
                per=spec.num_experts // plan.ep_size, experts=spec.num_experts, ep=plan.ep_size))]
              if plan.expert_parallel != "tp" else []),
            *([("LoRA adapter slots", f"{gib(plan.lora_slot_bytes)}  (in the weights above: --max-loras slots, "
                                      "each A and B of every projection at --max-lora-rank)")]
              if plan.lora_slot_bytes else []),
            ("forward workspace (estimate)", gib(plan.workspace_bytes)),
            ("KV cache budget", gib(plan.kv_budget_bytes)),
            ("KV cache per token", f"{plan.kv_bytes_per_token:,} bytes"),
            ("KV capacity", f"{plan.kv_capacity_tokens:,} tokens ({plan.num_kv_blocks:,} blocks of {block_size})"),
            (f"sequences of {plan.max_model_len:,} tokens", f"{plan.max_seqs_at_max_len:,}"),
            ("fits", "yes" if plan.fits else "NO: not one sequence of max-model-len fits"),
            *([("EP all-to-all", f"{plan.ep_all_to_all_bytes_per_token:,.0f} bytes sent per GPU per token")]
              if plan.ep_all_to_all_bytes_per_token else []),
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
    ranked = ("predicted time (compute + exposed communication + bubble)"
              if result.plans and result.plans[0].step is not None and not result.plans[0].step.end_to_end
              else "time at the end-to-end rate (the same for every layout: give --gpu to rank by communication)")
    summary = (f"{len(result.plans):,} of {result.considered:,} layouts fit; best {min(top, len(result.plans))} by "
               f"{ranked}")
    for reason, count in result.excluded.items():
        summary += f"\n{count:,} layouts not considered: {reason}"
    return "\n".join([model_line(spec), summary, "", table])
