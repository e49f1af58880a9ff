"""`engine bench suite`: the scenarios of benchmarks/scenarios.toml, run and rendered into BENCHMARKS.md.

    engine bench suite --list                      # one line a scenario
    engine bench suite --dry-run [--only NAME]     # the exact commands, nothing run
    engine bench suite --only decode-q4_1          # run it; its raw outputs under --results-dir,
                                                   # its table in BENCHMARKS.md rewritten

A scenario whose peer is missing (no llama.cpp build, no vLLM environment, no GPU) is skipped with one
line saying what to install. Each step's stdout, stderr and JSON go to --results-dir/NAME/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from engine.bench import suite_render
from engine.bench.common import RESULTS_DIR

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "benchmarks" / "scenarios.toml"
READERS = ("bench-json", "values-json", "llama-bench", "llama-batched-bench", "none")
NEEDS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-quantize", "vllm", "gpu")
BACKEND_LABELS = {"engine": "pagewise", "hf": "transformers", "vllm": "vLLM-CPU", "llamacpp": "llama.cpp"}
LLAMACPP_DIRS = ("/opt/llamacpp/bin", "~/.cache/pagewise/llamacpp/bin")


def load(path: Path = SCENARIOS) -> list[dict]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI (a dependency there)
        import tomli as tomllib
    scenarios = tomllib.loads(path.read_text())["scenario"]
    for s in scenarios:
        s.setdefault("rounds", 1)
        s.setdefault("needs", [])
        s.setdefault("prepare", [])
        s.setdefault("compare", [])
        s.setdefault("model", "{gguf}")
    return scenarios


def select(scenarios: list[dict], only: list[str]) -> list[dict]:
    names = [n for item in only for n in item.split(",") if n]
    known = {s["name"] for s in scenarios}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"engine bench suite: no scenario named {', '.join(unknown)}; "
                         "`engine bench suite --list` names them")
    return [s for s in scenarios if not names or s["name"] in names]


# --- where things are ------------------------------------------------------------------------------

def llamacpp_dir() -> str:
    for d in (os.environ.get("LLAMACPP_BIN"), *LLAMACPP_DIRS):
        if d and Path(d).expanduser().joinpath("llama-bench").exists():
            return str(Path(d).expanduser())
    found = shutil.which("llama-bench")
    return str(Path(found).parent) if found else str(Path(LLAMACPP_DIRS[0]))


def vllm_python() -> str:
    return os.environ.get("VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")


def default_gguf() -> str:
    try:
        from engine.loading.default_model import default_gguf_path

        return str(default_gguf_path())
    except Exception:  # the default model's package missing: the command still prints
        return "DEFAULT_MODEL.gguf"


def places(results_dir: Path, scenario: dict) -> dict[str, str]:
    return {"dir": str(results_dir / scenario["name"]), "models": str(results_dir / "models"),
            "gguf": default_gguf(), "llamacpp": llamacpp_dir(), "vllm_python": vllm_python()}


def fill(template: str, values: dict[str, str]) -> str:
    # str.format would read the JSON braces of an --extra-body as fields; only names we know are replaced.
    for key, value in values.items():
        template = template.replace("{" + key + "}", value)
    return template


def missing(need: str, values: dict[str, str]) -> str | None:
    """What to install or run for `need`, or None where it is there."""
    if need.startswith("llama-"):
        if not Path(values["llamacpp"], need).exists():
            return f"{need} (llama.cpp): build it with `bash benchmarks/llamacpp/build.sh` or set LLAMACPP_BIN"
    elif need == "vllm":
        if not Path(values["vllm_python"]).exists():
            return ("vLLM-CPU: install it into a virtual environment (.venv-vllm/ here) or give "
                    "VLLM_PYTHON=/path/to/venv/bin/python")
    elif need == "gpu":
        try:
            import torch

            if torch.cuda.is_available():
                return None
        except ImportError:
            pass
        return "a CUDA GPU: run it on a machine with one"
    return None


# --- running -----------------------------------------------------------------------------------------

def argv(command: str) -> list[str]:
    words = shlex.split(command)
    if words[0] == "engine":
        return [sys.executable, "-m", "engine", *words[1:]]
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    return words


def plan(scenario: dict, values: dict[str, str]) -> list[tuple[str, int, int, str, str]]:
    """(kind, round, step index, command, output file) in the order they run; rounds alternate order."""
    out = []
    for p in scenario["prepare"]:
        out.append(("prepare", 0, 0, fill(p["run"], values), fill(p["creates"], values)))
    steps = list(enumerate(scenario["step"]))
    for r in range(1, scenario["rounds"] + 1):
        for k, step in (steps if r % 2 else steps[::-1]):
            f = str(Path(values["dir"], f"step{k + 1}-round{r}.json"))
            out.append(("step", r, k, fill(step["run"], {**values, "out": f}), f))
    return out


def read(reader: str, out_file: str, stdout: str) -> dict[str, float]:
    if reader == "bench-json":
        d = json.loads(Path(out_file).read_text())
        if d.get("mode") == "serve":
            return {f"{BACKEND_LABELS.get(r['server'], r['server'])} c={r['max_concurrency']}":
                    r["metrics"]["output_throughput"] for r in d["runs"]}
        values = {}
        for r in d["results"]:
            label = BACKEND_LABELS.get(r["backend"], r["backend"])
            if d.get("mode") == "latency":
                values[label] = 1000.0 / r["tpot"]["median_ms"]
            else:
                values[label] = r["metrics"]["output_tokens_per_s"]
                values[f"{label} total"] = r["metrics"]["total_tokens_per_s"]
        return values
    if reader == "values-json":  # a tool's own {label: number} file
        return {label: float(v) for label, v in json.loads(Path(out_file).read_text()).items()}
    if reader == "llama-bench":
        return {"llama.cpp": float(json.loads(stdout)[0]["avg_ts"])}
    if reader == "llama-batched-bench":
        rows = [ln for ln in stdout.splitlines() if ln.startswith("|") and ln.split("|")[1].strip().isdigit()]
        if not rows:
            raise ValueError("llama-batched-bench printed no result row")
        return {"llama.cpp total": float(rows[-1].split("|")[-2])}
    return {}


def relabel(values: dict[str, float], label: str | None) -> dict[str, float]:
    if not label:
        return values
    return {label + k[len("pagewise"):] if k.startswith("pagewise") else k: v for k, v in values.items()}


def run(scenario: dict, results_dir: Path, log=print) -> dict:
    """Run one scenario; its per-round values and the same-run comparisons."""
    values = places(results_dir, scenario)
    Path(values["dir"]).mkdir(parents=True, exist_ok=True)
    Path(values["models"]).mkdir(parents=True, exist_ok=True)
    rounds: dict[int, dict[str, float]] = {}
    loads: list[float] = []
    todo = plan(scenario, values)
    for n, (kind, r, k, command, out_file) in enumerate(todo, 1):
        if kind == "prepare" and Path(out_file).exists():
            log(f"[suite] {scenario['name']} {n}/{len(todo)}: {out_file} exists, not prepared again")
            continue
        log(f"[suite] {scenario['name']} {n}/{len(todo)}" + (f" round {r}" if r else " prepare") + f": {command}")
        stem = Path(values["dir"], f"{kind}{k + 1}-round{r}")
        if kind == "step":
            loads.append(os.getloadavg()[0])
        start = time.monotonic()
        proc = subprocess.run(argv(command), cwd=ROOT, capture_output=True, text=True)
        stem.with_suffix(".out").write_text(proc.stdout)
        stem.with_suffix(".err").write_text(proc.stderr)
        log(f"[suite]   exit {proc.returncode} in {time.monotonic() - start:.0f} s")
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"{scenario['name']}: `{command}` exited {proc.returncode} "
                               f"({stem}.err):\n{tail}")
        if kind == "step":
            step = scenario["step"][k]
            rounds.setdefault(r, {}).update(relabel(read(step["read"], out_file, proc.stdout), step.get("label")))
    commands = [c for kind, _, _, c, _ in todo if kind == "step"]
    return {"name": scenario["name"], "rounds": rounds, "loads": loads, "commands": commands}


def compared(scenario: dict, result: dict) -> list[dict]:
    rows = []
    for c in scenario["compare"]:
        pairs = [(v[c["a"]], v[c["b"]]) for v in result["rounds"].values()]
        ratios = [a / b for a, b in pairs]
        rows.append({"case": c["case"], "a": c["a"], "b": c["b"], "ratios": ratios,
                     "a_median": statistics.median(a for a, _ in pairs),
                     "b_median": statistics.median(b for _, b in pairs)})
    return rows


def rendered_rows(scenario: dict, result: dict, machine: str, commit: str) -> list[str]:
    date = datetime.date.today().isoformat()
    command = " ; then ".join(s["run"] for s in scenario["step"])
    # The machines are shared: the load beside a run says how far its absolute numbers can be trusted.
    loads = result.get("loads") or [0.0]
    load = f"; 1-min load {min(loads):.1f}" + (f"-{max(loads):.1f}" if max(loads) > min(loads) + 0.05 else "")
    rows = []
    for c in compared(scenario, result):
        n = len(c["ratios"])
        result_text = (f"{c['a']} {c['a_median']:,.1f}, {c['b']} {c['b_median']:,.1f}"
                       + (f" (medians of {n} alternating rounds)" if n > 1 else "") + load)
        ratio = f"**{statistics.median(c['ratios']):.2f}x**"
        if n > 1:
            ratio += f" ({min(c['ratios']):.2f}-{max(c['ratios']):.2f})"
        rows.append(suite_render.row(c["case"], result_text, ratio, machine, commit, date, command))
    if not rows:
        rows.append(suite_render.row("run", f"outputs in the results folder, {scenario['name']}/", "",
                                     machine, commit, date, command))
    return rows


# --- the command ---------------------------------------------------------------------------------------

def add_arguments(p) -> None:
    p.add_argument("--list", action="store_true", help="name the scenarios, one line each, and stop")
    p.add_argument("--only", action="append", default=[], metavar="NAME[,NAME...]",
                   help="run these scenarios only (repeatable; default: every scenario)")
    p.add_argument("--dry-run", action="store_true", help="print the exact commands, run nothing")
    p.add_argument("--results-dir", default=RESULTS_DIR, metavar="DIR",
                   help="raw outputs go here, a folder per scenario (default: ./bench-results, which git ignores)")
    p.add_argument("--benchmarks-md", default=str(ROOT / "BENCHMARKS.md"), metavar="PATH",
                   help="the file whose marked tables are rewritten (default: the checkout's BENCHMARKS.md)")
    p.add_argument("--scenarios", default=str(SCENARIOS), metavar="TOML", help=argparse.SUPPRESS)


def main(args) -> int:
    scenarios = select(load(Path(args.scenarios)), args.only)
    results_dir = Path(args.results_dir).resolve()
    if args.list:
        width = max(len(s["name"]) for s in scenarios)
        for s in scenarios:
            needs = f" [needs {', '.join(s['needs'])}]" if s["needs"] else ""
            print(f"{s['name']:<{width}}  {s['topic']}: {s['measures']}{needs}")
        return 0
    if args.dry_run:
        for s in scenarios:
            values = places(results_dir, s)
            print(f"# {s['name']}: {s['measures']} (bar: {s['bar']})")
            for need in s["needs"]:
                if (why := missing(need, values)):
                    print(f"# would be skipped here: needs {why}")
            for kind, r, _, command, out_file in plan(s, values):
                prefix = f"[ -e {shlex.quote(out_file)} ] || " if kind == "prepare" else ""
                print(prefix + command)
        return 0
    machine, commit = suite_render.machine(), suite_render.commit(ROOT)
    md = Path(args.benchmarks_md)
    failed = 0
    for s in scenarios:
        values = places(results_dir, s)
        gaps = [why for need in s["needs"] if (why := missing(need, values))]
        if gaps:
            print(f"[suite] {s['name']}: skipped, needs {'; '.join(gaps)}")
            continue
        try:
            result = run(s, results_dir)
        except (RuntimeError, ValueError, KeyError, OSError) as e:
            print(f"[suite] {s['name']}: failed: {e}", file=sys.stderr)
            failed += 1
            continue
        rows = rendered_rows(s, result, machine, commit)
        Path(values["dir"], "result.json").write_text(json.dumps({**result, "rows": rows}, indent=1))
        md.write_text(suite_render.replace_block(md.read_text(), s, rows))
        print(f"[suite] {s['name']}: table rewritten in {md.name}")
        for line in rows:
            print("  " + line)
    return 1 if failed else 0
