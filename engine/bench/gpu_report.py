"""gpu_check's report: the GPU path's targets judged from the measured numbers, the markdown summary
and the decode-anatomy PNG (engine/bench/gpu_check.py runs the stages that measure them)."""

from __future__ import annotations

# The GPU path's targets (H100/H200): decode >= 70% of copy bandwidth at batch 1 (1B, bf16), graphs
# >= 2x eager at batch 1, <= 12 kernels per layer per eager step, one graph launch per step.
DECODE_COPY_TARGET, GRAPH_SPEEDUP_TARGET, KERNELS_PER_LAYER_TARGET = 0.70, 2.0, 12


def kernels_per_layer(eager: list[dict]) -> tuple[float | None, str]:
    """Kernels one layer adds to an eager decode step: the slope between two models of different
    depth at the same batch (the step's fixed part, embedding, LM head and sampler, cancels), else
    the whole step over the layers (an upper bound)."""
    if not eager:
        return None, ""
    slopes = [(a["kernels_per_step"] - b["kernels_per_step"]) / (a["num_layers"] - b["num_layers"])
              for a in eager for b in eager if a["batch"] == b["batch"] and a["num_layers"] > b["num_layers"]]
    what = eager[0]["kernels_counted"]
    if slopes:
        return max(slopes), f"{what}; slope between models of different depth"
    return max(r["kernels_per_step"] / r["num_layers"] for r in eager), f"{what}; whole step / layers"


def summarize(report: dict) -> list[dict]:
    """The GPU path's targets, each met, missed or not measured (None), with the number behind it."""
    bench = report.get("kernel_bench") or {}
    rows = bench.get("rows") or []
    copy_gb = (bench.get("meta") or {}).get("copy_gb_per_s")
    anatomy = report.get("anatomy") or []
    out = []

    def target(name, value, met, note=""):
        out.append(dict(target=name, value=value, met=met, note=note))

    decode = [r for r in rows if r["phase"] == "decode" and r.get("target")]
    target("decode attention >= 70% of copy bandwidth (batch >= 16, context >= 2048)",
           min((r["fraction"] for r in decode), default=None), all(r["meets"] for r in decode) if decode else None)
    prefill = [r for r in rows if r["phase"] == "prefill"]
    target("prefill attention >= 80% of torch SDPA", min((r["fraction"] for r in prefill), default=None),
           all(r["meets"] for r in prefill) if prefill else None)
    big = [r for r in anatomy if r["model"] == "llama-3.2-1b" and r["batch"] == 1]
    by_mode = {r["mode"]: r for r in big}
    fastest = min(big, key=lambda r: r["step_ms"]) if big else None
    frac = fastest["gb_per_s"] / copy_gb if fastest and copy_gb else None
    target("batch-1 decode, Llama-3.2-1B shape: >= 70% of copy bandwidth (weights + KV bytes x steps/s)",
           frac, None if frac is None else frac >= DECODE_COPY_TARGET, fastest and f"mode {fastest['mode']}")
    speedup = (by_mode["eager"]["step_ms"] / by_mode["graphs"]["step_ms"]
               if "eager" in by_mode and "graphs" in by_mode else None)
    from engine.bench.decode_anatomy import supports_graph_switch

    target("graphs vs eager at batch 1 >= 2x", speedup, None if speedup is None else speedup >= GRAPH_SPEEDUP_TARGET,
           "" if supports_graph_switch() else "needs EngineConfig.enforce_eager")
    per_layer, how = kernels_per_layer([r for r in anatomy if r["mode"] in ("eager", "default")])
    target("kernels per decode step <= 12 per layer without graphs", per_layer,
           None if per_layer is None else per_layer <= KERNELS_PER_LAYER_TARGET, how)
    graphed = [r for r in anatomy if r["mode"] == "graphs" and r.get("graph_launches_per_step") is not None]
    launches = max((r["graph_launches_per_step"] for r in graphed), default=None)
    target("one graph replay per decode step with graphs", launches, None if launches is None else launches == 1)
    target("engine throughput >= 5x transformers generate", None, None,
           "not run here: engine bench throughput --compare engine,hf")
    if report.get("dry_run"):  # CPU and tiny shapes: the arithmetic ran, nothing was measured
        out = [dict(t, met=None, note="dry run") for t in out]
    return out


def _fmt(v, spec=".3g") -> str:
    if v is None:
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def markdown(report: dict) -> str:
    env = report["env"] or {}
    lines = ["# gpu_check" + (" (DRY RUN: CPU, tiny shapes; the numbers check the pipeline, not hardware)"
                              if report["dry_run"] else ""), ""]
    dev = env.get("device") or {}
    versions = env.get("versions") or {}
    lines += [f"- device: {dev.get('name')} ({', '.join(f'{k} {v}' for k, v in dev.items() if k != 'name')})",
              f"- nvidia-smi: {env.get('nvidia_smi') or '-'}",
              "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
              f"- C toolchain for Triton's launcher: {'ok' if (env.get('toolchain') or {}).get('ok') else 'MISSING'}"
              f" ({(env.get('toolchain') or {}).get('cc_version') or (env.get('toolchain') or {}).get('error')})",
              f"- wall time: {report['wall_s']:.0f} s", "", "## Stages", "",
              "| stage | ok | seconds | note |", "|---|---|---|---|"]
    for name, st in report["stages"].items():
        note = "timed out" if st.get("timed_out") else st.get("note", "")
        lines.append(f"| {name} | {'yes' if st.get('ok') else 'NO'} | {_fmt(st.get('seconds'), '.1f')} | {note} |")
    tests = report.get("tests") or {}
    if tests:
        lines += ["", f"## Tests: {tests.get('passed')} passed, {tests.get('failed')} failed, "
                      f"{tests.get('errors')} errors, {tests.get('skipped')} skipped", ""]
        lines += [f"- FAILED {t}" for t in tests.get("failures", [])]
    bench = report.get("kernel_bench")
    if bench:
        lines += ["", f"## Kernel bench (copy bandwidth {_fmt(bench['meta'].get('copy_gb_per_s'), '.0f')} GB/s, "
                      f"{bench['meta'].get('dtype')})", "",
                  "| phase | batch | context | splits | ms | achieved | fraction | target |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in bench["rows"]:
            achieved = f"{r['gb_per_s']:.0f} GB/s" if r["phase"] == "decode" else f"{r['tflops']:.1f} TFLOP/s"
            target = "-" if r.get("target") is None else f">= {r['target']:.0%} {'ok' if r['meets'] else 'MISSED'}"
            lines.append(f"| {r['phase']} | {r['batch']} | {r['context']} | {r['splits']} | {r['ms']:.4f} | "
                         f"{achieved} | {r['fraction']:.1%} | {target} |")
    anatomy = report.get("anatomy") or []
    if anatomy:
        lines += ["", "## Decode anatomy", "",
                  "| model | mode | batch | context | ms/step | tok/s | GB/s | kernels/step | per layer | "
                  "host launches | graph launches | GPU busy |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in anatomy:
            lines.append(f"| {r['model']} | {r['mode']} | {r['batch']} | {r['context']} | {r['step_ms']:.3f} | "
                         f"{r['tok_s']:.0f} | {r['gb_per_s']:.1f} | {r['kernels_per_step']:.0f} | "
                         f"{r['kernels_per_step'] / r['num_layers']:.1f} | "
                         f"{_fmt(r['host_launches_per_step'], '.0f')} | {_fmt(r['graph_launches_per_step'], '.0f')} | "
                         f"{_fmt(r['gpu_busy'], '.0%')} |")
        lines += ["", f"Kernels counted as: {anatomy[0]['kernels_counted']}."]
        for r in anatomy:
            if r.get("top_kernels") and r["mode"] != "eager":  # eager lists the same kernels, slower to launch
                lines += ["", f"### Kernels of a step: {r['model']}, {r['mode']}, batch {r['batch']}", "",
                          "| us/step | launches/step | kernel |", "|---|---|---|"]
                lines += [f"| {k['us_per_step']:.1f} | {k['per_step']:.1f} | `{k['name'][:100]}` |"
                          for k in r["top_kernels"]]
    lines += ["", "## Targets", "", "| target | value | met | note |", "|---|---|---|---|"]
    for t in report["targets"]:
        met = "-" if t["met"] is None else ("yes" if t["met"] else "MISSED")
        lines.append(f"| {t['target']} | {_fmt(t['value'])} | {met} | {t['note'] or ''} |")
    return "\n".join(lines) + "\n"


def plot_anatomy(rows: list[dict], path: str) -> str | None:
    """Step time, kernels per step and GPU busy per (model, batch), one bar per graph mode."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG"
    keys = sorted({(r["model"], r["batch"]) for r in rows})
    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        got = {(r["model"], r["batch"]): r for r in rows if r["mode"] == mode}
        xs = [i + j * width for i in range(len(keys))]
        for ax, field in zip(axes, ("step_ms", "tok_s", "kernels_per_step", "gpu_busy")):
            ax.bar(xs, [(got[k].get(field) or 0) if k in got else 0 for k in keys], width, label=mode)
    for ax, title in zip(axes, ("ms per decode step", "tokens/s", "kernels per decode step",
                                "GPU busy fraction (CUDA only)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))], [f"{m}\nbatch {b}" for m, b in keys],
                      fontsize=8)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None
