"""What every bench mode prints and saves: environment facts, tables, the JSON report."""

from __future__ import annotations

import json
import os
import platform
import sys
import time


def environment() -> dict:
    """Machine and library facts that make a number reproducible."""
    env = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
        env["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return env


def warn_if_busy() -> None:
    """Other work on the cores skews every number (and torch's spinning threads make it worse)."""
    if not hasattr(os, "getloadavg"):
        return
    load1 = os.getloadavg()[0]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if load1 > 0.5 * cores:
        print(f"note: the machine is busy (1-minute load average {load1:.1f} on {cores} cores): "
              "timings will be noisy; compare backends only within one run", file=sys.stderr)


def _strict(obj):
    """inf / nan are not JSON: write them as strings ("inf"), so any parser reads the file."""
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_strict(v) for v in obj]
    return obj


def write_json(path: str, report: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_strict(report), f, indent=2, default=str, allow_nan=False)
    print(f"wrote {path}")


def table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-flavoured Markdown table (readable in a terminal too)."""
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) >= 1 or v == 0 else f"{v:.3f}"
        return "" if v is None else str(v)

    body = [[cell(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in body)])


def _first_line(text: str | None, width: int = 60) -> str:
    lines = (text or "unknown error").strip().splitlines() or ["unknown error"]
    return lines[0][:width]


def throughput_table(results: list[dict], baseline: str = "engine") -> str:
    base = next((r for r in results if r.get("backend") == baseline and "metrics" in r), None)
    rows = []
    for r in results:
        m = r.get("metrics")
        if m is None:
            rows.append([r["backend"], None, None, None, None, None, None, "n/a",
                         "failed: " + _first_line(r.get("error"))])
            continue
        ratio = m["output_tokens_per_s"] / base["metrics"]["output_tokens_per_s"] if base else None
        rows.append([
            r["backend"], m["requests_per_s"], m["output_tokens_per_s"], m["total_tokens_per_s"],
            m["wall_s"], r["startup_s"], r.get("threads"),
            f"{ratio:.2f}x" if ratio is not None else "n/a",
            "ok" if r["token_count_ok"] else f"MISMATCH ({m['total_output_tokens']} of {r['expected_output_tokens']})",
        ])
    return table(
        ["backend", "req/s", "output tok/s", "total tok/s", "wall s", "start-up s", "threads",
         f"vs {baseline}", "output tokens"],
        rows,
    )


def speculation_line(results: list[dict]) -> str | None:
    """The engine's speculative decoding, as vLLM reports it: mean accepted length (1 + accepted drafts
    per draft run) and the acceptance rate of the draft tokens; None when nothing was drafted."""
    for r in results:
        stats = (r.get("info") or {}).get("engine_stats") or {}
        if stats.get("num_drafts"):
            drafts, accepted = stats["num_draft_tokens"], stats["num_accepted_tokens"]
            return (f"speculative decoding [{r['backend']}]: mean accepted length "
                    f"{1 + accepted / stats['num_drafts']:.2f} ({accepted} of {drafts} draft tokens accepted, "
                    f"{accepted / drafts:.0%}, in {stats['num_drafts']} draft runs)")
    return None


def latency_table(results: list[dict], percentiles: list[float]) -> str:
    rows = []
    for r in results:
        if "e2e" not in r:
            rows.append([r["backend"], "failed: " + _first_line(r.get("error"))] + [None] * (len(percentiles) + 4))
            continue
        e, t, p = r["e2e"], r["ttft"], r["tpot"]
        # Decode tok/s as llama.cpp users read it (llama-bench's tg): tokens of the batch per TPOT.
        decode = r["batch_size"] * 1000.0 / p["mean_ms"] if p["mean_ms"] else None
        rows.append([r["backend"], e["mean_ms"], *(e[f"p{q:g}_ms"] for q in percentiles),
                     t["mean_ms"], p["mean_ms"], decode, r["startup_s"]])
    return table(
        ["backend", "e2e mean ms", *(f"e2e p{q:g} ms" for q in percentiles), "TTFT mean ms",
         "TPOT mean ms", "decode tok/s", "start-up s"],
        rows,
    )


def serve_summary(m: dict, percentiles: list[float]) -> str:
    lines = [
        f"{'Successful requests:':<40}{m['completed']}",
        f"{'Failed requests:':<40}{m['failed']}",
        f"{'Benchmark duration (s):':<40}{m['duration_s']:.2f}",
        f"{'Total input tokens:':<40}{m['total_input_tokens']}",
        f"{'Total generated tokens:':<40}{m['total_output_tokens']}",
        f"{'Request throughput (req/s):':<40}{m['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<40}{m['output_throughput']:.2f}",
        f"{'Total token throughput (tok/s):':<40}{m['total_token_throughput']:.2f}",
    ]
    if "request_goodput" in m:
        lines.append(f"{'Request goodput (req/s):':<40}{m['request_goodput']:.2f}")
    names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
             "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key, title in names.items():
        d = m[key]
        lines.append(f"{title:-^50}")
        lines.append(f"{'Mean ' + key.upper() + ' (ms):':<40}{d['mean_ms']:.2f}")
        lines.append(f"{'Median ' + key.upper() + ' (ms):':<40}{d['median_ms']:.2f}")
        for q in percentiles:
            lines.append(f"{f'P{q:g} ' + key.upper() + ' (ms):':<40}{d[f'p{q:g}_ms']:.2f}")
    return "\n".join(lines)
