"""The GPU kernels of one decode step, each with its time per step (a GPU probe).

    python benchmarks/gpu/kernel_profile.py --model DIR [--quantizations int4] [--batch 1] [--context 1024]

For bf16 and each --quantizations kind, with CUDA graphs on (the default engine): B requests
prefilled, warm steps, then --steps decode steps under torch.profiler. Prints, per step: the wall
time, the sum of the kernels' device times (the rest is the GPU idle between kernels or waiting on
the host), and the kernels grouped by name with their count and microseconds per step.
"""

from __future__ import annotations

import argparse
import json
import time

import engine_variants  # benchmarks/gpu, beside this script


def profile(model: str, batch: int, context: int, steps: int, quantization: str | None) -> dict:
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from engine.bench.decode_anatomy import build_engine, start_decoding, top_kernels

    on_cuda = torch.cuda.is_available()  # CPU: a rehearsal of the script, no kernels to list

    def sync():
        if on_cuda:
            torch.cuda.synchronize()

    extra = engine_variants.engine_kwargs(quantization)
    llm = build_engine(model, batch, context, steps * 2 + 64, "bfloat16" if on_cuda else "float32", False, **extra)
    core = llm.engine
    ids = start_decoding(core, batch, context, steps * 2 + 32)
    for _ in range(5):
        core.step()
    sync()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            core.step()
        sync()
        wall = time.perf_counter() - t0
    core.abort_request(ids)
    core.step()
    llm.shutdown()
    device = [e for e in prof.events()
              if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start]
    kernels = top_kernels(device, steps, top=len(device))
    return dict(quantization=quantization or "bf16", batch=batch, context=context, wall_us=wall / steps * 1e6,
                kernel_us=sum(k["us_per_step"] for k in kernels), kernels=kernels)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quantizations", default="int4")
    p.add_argument("--top", type=int, default=16)
    p.add_argument("--output-json", default=None)
    engine_variants.add_arguments(p)
    args = p.parse_args()
    engine_variants.apply_arguments(args)
    rows = []
    for q in [None] + [q for q in args.quantizations.split(",") if q]:
        try:
            r = profile(args.model, args.batch, args.context, args.steps, q)
        except Exception as e:
            print(f"{q}: failed: {e!r}", flush=True)
            continue
        rows.append(r)
        print(f"== {r['quantization']} batch {r['batch']} context {r['context']}: {r['wall_us']:.0f} us/step wall, "
              f"{r['kernel_us']:.0f} us/step in kernels ({r['kernel_us'] / r['wall_us']:.0%})", flush=True)
        for k in r["kernels"][:args.top]:
            print(f"  {k['us_per_step']:8.1f} us  x{k['per_step']:5.1f}  {k['name'][:110]}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
