"""Where a graph-replayed decode step spends its host time, and what weight-only quantization buys
at batch 1 (a GPU probe; its output is the record).

    python benchmarks/gpu/host_profile.py --model DIR [--quantizations int4,int8,int4+head] [--steps 200]
        [--packed-tiles F] [--set MODULE.NAME=JSON]

For each configuration (bf16, then each --quantizations kind): an engine built as
engine.bench.decode_anatomy builds it, B requests prefilled, then timed decode steps (median ms,
tok/s) with each phase of EngineCore.step timed by wrapping its methods (schedule, the runner's
update_states / _prepare_inputs / _forward / _sample, the rest = output processing), and the GPU
time of the same steps from CUDA events around the forward alone. Then cProfile over the bf16 run's
steps, top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import engine_variants  # benchmarks/gpu, beside this script


class Phases:
    """Accumulates wall time per wrapped method."""

    def __init__(self):
        self.total: dict[str, float] = {}

    def wrap(self, obj, name: str, label: str | None = None):
        fn = getattr(obj, name)
        label = label or name

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] = self.total.get(label, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)


def measure(model: str, batch: int, context: int, steps: int, quantization: str | None, profile: bool) -> dict:
    import torch

    from engine.bench.decode_anatomy import build_engine, start_decoding

    extra = engine_variants.engine_kwargs(quantization)
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    llm = build_engine(model, batch, context, steps * 3 + 64, dtype, False, **extra)
    core = llm.engine
    runner = core.runner
    ids = start_decoding(core, batch, context, steps * 3 + 32)
    for _ in range(5):
        core.step()
    on_cuda = torch.cuda.is_available()  # CPU: a rehearsal of the script (no GPU time)
    if on_cuda:
        torch.cuda.synchronize()
    plain = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        plain.append(time.perf_counter() - t0)
    # GPU time of the forward alone: events around the forward, the host waiting after each.
    fwd = runner._forward
    gpu_ms = []

    def timed_forward(step):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fwd(step)
        b.record()
        b.synchronize()
        gpu_ms.append(a.elapsed_time(b))
        return out

    if on_cuda:
        runner._forward = timed_forward
        for _ in range(steps // 2):
            core.step()
        runner._forward = fwd
    phases = Phases()
    phases.wrap(core.scheduler, "schedule")
    for name in ("update_states", "_prepare_inputs", "_forward", "_sample", "execute_model"):
        phases.wrap(runner, name)
    stepped = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        stepped.append(time.perf_counter() - t0)
    per = {k: v / steps * 1e3 for k, v in phases.total.items()}  # before cProfile's steps add to them
    prof_text = None
    if profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(steps):
            core.step()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35)
        prof_text = s.getvalue()
    core.abort_request(ids)
    core.step()
    llm.shutdown()
    per["core_rest"] = statistics.mean(stepped) * 1e3 - per.get("schedule", 0) - per.get("execute_model", 0)
    per["runner_rest"] = per.get("execute_model", 0) - sum(per.get(k, 0) for k in
                                                           ("update_states", "_prepare_inputs", "_forward", "_sample"))
    step_ms = statistics.median(plain) * 1e3
    return dict(quantization=quantization or "bf16", batch=batch, context=context, step_ms=step_ms,
                step_ms_min=min(plain) * 1e3, tok_s=batch / step_ms * 1e3,
                forward_gpu_ms=statistics.median(gpu_ms) if gpu_ms else float("nan"), phases_ms=per, profile=prof_text)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--quantizations", default="int4,int8")
    p.add_argument("--output-json", default=None)
    engine_variants.add_arguments(p)
    args = p.parse_args()
    engine_variants.apply_arguments(args)
    rows = []
    kinds = [None] + [q for q in args.quantizations.split(",") if q]
    for i, q in enumerate(kinds):
        try:
            r = measure(args.model, args.batch, args.context, args.steps, q, profile=i == 0)
        except Exception as e:  # one failing kind must not lose the others' numbers
            print(f"{q}: failed: {e!r}", flush=True)
            continue
        rows.append(r)
        print(f"{r['quantization']}: {r['step_ms']:.3f} ms/step (min {r['step_ms_min']:.3f}), {r['tok_s']:.0f} tok/s, "
              f"forward GPU {r['forward_gpu_ms']:.3f} ms; phases (ms): "
              + ", ".join(f"{k} {v:.3f}" for k, v in r["phases_ms"].items()), flush=True)
        if r["profile"]:
            print(r["profile"], flush=True)
    base = rows[0]["tok_s"] if rows and rows[0]["quantization"] == "bf16" else None
    for r in rows[1:]:
        if base:
            print(f"{r['quantization']} vs bf16 at batch {args.batch}: {r['tok_s'] / base:.2f}x tok/s")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
