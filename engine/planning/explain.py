"""`--explain`: each figure of a training plan with the formula that produced it and where it comes from."""

from __future__ import annotations

from engine.planning.memory import optimizer_bytes_per_param, weight_bytes
from engine.planning.spec import ModelSpec
from engine.planning.training import TrainPlan
from engine.planning.units import GiB


def explain_training(spec: ModelSpec, plan: TrainPlan, precision: str, seq_len: int, flops_method: str,
                     optimizer: str = "adamw") -> str:
    lay, mem, b = plan.layout, plan.memory_per_gpu, weight_bytes(precision)
    k = optimizer_bytes_per_param(precision, optimizer)
    shard = {3: "/ N_d (ZeRO-3)"}.get(lay.zero, "")
    n = "active parameters" if spec.is_moe else "parameters"
    lines = [
        ("parameters", f"{plan.params:,}", "counted tensor by tensor from the config (spec.py), as transformers' "
                                           "model.parameters() yields them"),
        ("weights", f"{mem.weights / GiB:.2f} GiB", f"{b} B x parameters on the busiest TP/PP rank {shard} "
                                                    "(Rajbhandari et al. 2020, ZeRO §3.1, Figure 1)"),
        ("gradients", f"{mem.gradients / GiB:.2f} GiB",
         f"{b} B x parameters{' / N_d (ZeRO >= 2)' if lay.zero >= 2 else ''} (ZeRO Figure 1)"),
        ("optimizer", f"{mem.optimizer / GiB:.2f} GiB",
         f"K = {k} B x parameters{' / N_d (ZeRO >= 1)' if lay.zero >= 1 else ''} + a 4 B step per tensor "
         "(ZeRO §3.1: K = 12 for mixed-precision Adam)"),
        ("activations", f"{mem.activations / GiB:.2f} GiB",
         f"per layer {plan.activations_per_layer / GiB:.3f} GiB, op by op: sbh(34 + 5as/h) for GPT "
         "(Korthikanti et al. 2022, Table 2), x layers in flight under 1F1B (Narayanan et al. 2021, §2.2)"),
        ("steps", f"{plan.steps:,}", "ceil(tokens / (global batch x seq_len)); global batch = grad-accum x DP x "
                                     "micro-batch"),
        ("FLOPs", f"{plan.flops:.4g}",
         f"6 x {n} x tokens (Kaplan et al. 2020, §2.1), 8x with full recomputation" if flops_method == "nd" else
         "per layer: 2 FLOPs per weight x tokens + attention 4 s q_size, x3 for backward (Narayanan et al. 2021, "
         "eq. 3)"),
    ]
    if plan.lora is not None:
        lines[1:4] = _lora_lines(plan, b, k, optimizer)
        lines[-1] = ("FLOPs", f"{plan.flops:.4g}", (
            "4 x parameters x tokens for the frozen base (forward + input gradients) + 6 x adapter parameters x "
            "tokens; one more forward of each with full recomputation" if flops_method == "nd" else
            "per layer: 2 FLOPs per weight x tokens, x2 for frozen weights (no weight gradient), x3 for the adapters "
            "and attention scores (Narayanan et al. 2021, eq. 3, less the frozen weights' gradients)"))
    for c in plan.communication:
        link = "across nodes" if c["crosses_nodes"] else "inside a node"
        secs = "" if c["seconds"] is None else f", {c['seconds']:.3g} s per step"
        lines.append((c["name"], f"{c['bytes'] / GiB:.3f} GiB per GPU per step",
                      f"{c['formula']}; over {c['ranks']} ranks {link}{secs}"))
    step = plan.step
    if step is None:
        lines.append(("time", "-", "give --gpu, --peak-tflops (with bandwidths), --achieved-tflops, --mfu or "
                                   "--time-per-step"))
    elif step.end_to_end:
        lines.append(("step time", f"{step.total:.4g} s", "from the published / measured rate, end to end: "
                                                          "no bubble or communication added (Narayanan 2021, eq. 4)"))
    else:
        lines += [
            ("compute", f"{step.compute:.4g} s per step", "FLOPs per GPU per step / (peak x compute efficiency)"),
            ("exposed comm", f"{step.exposed_communication:.4g} s per step",
             "TP, PP and EP in full; DP sync minus the overlapped share (at most the backward it hides behind)"),
            ("bubble", f"{step.bubble:.4g} s per step",
             f"(p - 1) / m = ({lay.pp} - 1) / {lay.grad_accum} x (compute + TP + EP) (Narayanan 2021, §2.2.1)"),
            ("step time", f"{step.total:.4g} s", "compute + exposed communication + bubble"),
        ]
    if plan.mfu is not None:
        lines.append(("MFU / HFU", f"{plan.mfu:.1%} / {plan.hfu:.1%}",
                      "model (resp. executed) FLOPs per second / (GPUs x peak) (Chowdhery et al. 2022, PaLM, App. B)"))
    width = max(len(label) for label, _, _ in lines)
    return "how each figure was computed\n" + "\n".join(
        f"  {label:<{width}}  {value}\n  {'':<{width}}    = {how}" for label, value, how in lines)


def _lora_lines(plan: TrainPlan, b: int, k: int, optimizer: str) -> list[tuple[str, str, str]]:
    lora, mem = plan.lora, plan.memory_per_gpu
    frozen = lora["frozen_weights_per_gpu"]
    return [
        ("weights", f"{mem.weights / GiB:.2f} GiB",
         f"frozen base {frozen / GiB:.2f} GiB, linear layers in {lora['base_storage']} (QLoRA, Dettmers et al. 2023, "
         f"§3), the rest {b} B a parameter; + {b} B x {plan.trainable_params:,} adapter parameters: r (in + out) per "
         "targeted projection per layer (Hu et al. 2021, §4.1)"),
        ("gradients", f"{mem.gradients / GiB:.2f} GiB", f"{b} B x adapter parameters (the base gets none)"),
        ("optimizer", f"{mem.optimizer / GiB:.2f} GiB", f"K = {k} B x adapter parameters"
         + (" + a 4 B step per tensor (torch's AdamW)" if optimizer == "adamw" else "") + " (ZeRO §3.1)"),
    ]
