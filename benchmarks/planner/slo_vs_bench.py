"""`engine plan serve --gpu cpu --concurrency c` against `engine bench serve --max-concurrency c` on this machine.

    python benchmarks/planner/slo_vs_bench.py --concurrency 1,8,32 --output benchmarks/planner/slo-cpu-default-bf16.json

For each c, once the 1-minute load average is below --quiet (checked every minute, at most --wait-minutes): the
planner measures this CPU and predicts, then a fresh `engine serve` is launched and measured with 32 requests of
128 random prompt tokens and 64 output tokens, EOS ignored. The load average is recorded before and after each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

METRICS = (("ttft_ms", "ttft", 1e3), ("tpot_ms", "tpot", 1e3), ("output_tok_s", "throughput", 1.0))


def load_average() -> list[float]:
    return list(os.getloadavg())


def wait_quiet(threshold: float, minutes: float) -> list[float]:
    deadline = time.monotonic() + 60 * minutes
    while (load := load_average())[0] >= threshold and time.monotonic() < deadline:
        print(f"load {load[0]:.2f} >= {threshold}: waiting a minute", file=sys.stderr, flush=True)
        time.sleep(60)
    return load


def run(c: int, model: str, args: argparse.Namespace) -> dict:
    lengths = ["--prompt-len", str(args.input_len), "--output-len", str(args.output_len)]
    planned = subprocess.run([sys.executable, "-m", "engine", "plan", "serve", "--model", model, "--gpu", "cpu",
                              "--dtype", "bfloat16", "--kv-cache-memory", "2GiB", *lengths, "--slo", "--concurrency",
                              str(c), "--json"], capture_output=True, text=True, check=True)
    plan = json.loads(planned.stdout)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        subprocess.run([sys.executable, "-m", "engine", "bench", "serve", "--launch", "engine", "--dtype", "bfloat16",
                        "--max-concurrency", str(c), "--num-prompts", str(args.num_prompts), "--input-len",
                        str(args.input_len), "--output-len", str(args.output_len), "--disable-tqdm", "--output-json",
                        out], check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            bench = json.load(f)
    (measured_run,) = bench["runs"]
    m = measured_run["metrics"]
    measured = {"ttft_ms": m["ttft"]["mean_ms"], "tpot_ms": m["tpot"]["mean_ms"],
                "output_tok_s": m["output_throughput"]}
    (p,) = plan["predictions"]
    predicted = {name: p[key] * scale for name, key, scale in METRICS}
    return {"concurrency": c, "device": plan["device"], "predicted": predicted, "measured": measured,
            "predicted_over_measured": {k: predicted[k] / measured[k] for k in measured}, "bench_metrics": m}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--quiet", type=float, default=1.5, help="1-minute load average to wait for")
    p.add_argument("--wait-minutes", type=float, default=20)
    p.add_argument("--output", required=True)
    args = p.parse_args()
    from engine.loading.default_model import default_model_path

    model = default_model_path()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip())
    rows = []
    for c in (int(v) for v in args.concurrency.split(",")):
        before = wait_quiet(args.quiet, args.wait_minutes)
        row = run(c, model, args)
        row["load_average_before"], row["load_average_after"] = before, load_average()
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("concurrency", "load_average_before", "predicted", "measured",
                                              "predicted_over_measured")}), flush=True)
    what = ("engine plan serve --gpu cpu --concurrency c (device measured at start through the engine's CPU kernels) "
            f"vs engine bench serve --launch engine --dtype bfloat16 --max-concurrency c --num-prompts "
            f"{args.num_prompts} --input-len {args.input_len} --output-len {args.output_len}, default model, "
            "a fresh server per concurrency")
    with open(args.output, "w") as f:
        json.dump({"what": what, "commit": commit, "working_tree_dirty": dirty, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
