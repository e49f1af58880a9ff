"""`python -m loadtest`: start a server, run Locust headless against it, write a report.

    python -m loadtest --users 8 --spawn-rate 2 --run-time 60s --out-dir loadtest-report
    python -m loadtest --host http://10.0.0.5:8000 --users 32 --run-time 5m   # an existing server

Without --host it starts `python -m server.cli serve` on 127.0.0.1 (a free port), waits
for /health, and stops it (its whole process group) afterwards. Locust runs as a
subprocess with a hard time bound; its CSV files and HTML report land in --out-dir.
Exit status: 0 when the failure ratio (failed / all requests, TTFT entries excluded) is
at most --max-failure-ratio (default 0.01: a 1% budget for transient errors on long
runs; pass 0 for a strict run), 1 when it is above or no request completed, 2 when
Locust itself failed.
"""

from __future__ import annotations

import argparse
import csv
import os
import signal
import subprocess
import sys

from engine.bench.launch import REPO_ROOT, ServerProcess, engine_server_cmd, health_ok

LOCUSTFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "locustfile.py")


def parse_run_time(text: str) -> float:
    """Locust's run-time syntax: 90, 90s, 2m, 1h30m -> seconds."""
    total, num = 0.0, ""
    for ch in text.strip():
        if ch.isdigit() or ch == ".":
            num += ch
        elif ch in "hms" and num:
            total += float(num) * {"h": 3600, "m": 60, "s": 1}[ch]
            num = ""
        else:
            raise argparse.ArgumentTypeError(f"run time like 30s, 5m or 1h30m, got {text!r}")
    return total + (float(num) if num else 0.0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default=None, help="base URL of a running server (default: start one here)")
    p.add_argument("--model", default=None, help="model folder for the started server (default: the embedded one)")
    p.add_argument("--model-name", default=None, help="model name in requests (default: GET /v1/models)")
    p.add_argument("--api-key", default=None, help="bearer token (default: $PAGEWISE_API_KEY / $OPENAI_API_KEY)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the started server, e.g. --server-arg=--dtype=float32 (repeatable)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--spawn-rate", type=float, default=2.0, help="users started per second")
    p.add_argument("--run-time", default="30s", help="Locust run time, e.g. 30s, 5m (default %(default)s)")
    p.add_argument("--max-prompt-words", type=int, default=None, help="cap on prompt length (locustfile default 400)")
    p.add_argument("--max-output-tokens", type=int, default=None, help="cap on max_tokens (locustfile default 128)")
    p.add_argument("--out-dir", default="loadtest-report", help="where the CSV and HTML reports go")
    p.add_argument("--max-failure-ratio", type=float, default=0.01,
                   help="exit non-zero above this failed/total ratio (default %(default)s)")
    return p


def read_stats(prefix: str) -> list[dict]:
    with open(f"{prefix}_stats.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _ms(value) -> str:
    try:
        return f"{float(value):.0f}"
    except (TypeError, ValueError):
        return str(value or "")


def summarize(rows: list[dict]) -> tuple[str, int, int]:
    """A table of the Locust entries, and (requests, failures) over the real requests."""
    lines = [f"{'type':<6} {'name':<24} {'reqs':>6} {'fails':>6} {'median ms':>10} {'p95 ms':>8} "
             f"{'p99 ms':>8} {'req/s':>7}"]
    total = fails = 0
    for r in rows:
        lines.append(f"{r['Type']:<6} {r['Name'][:24]:<24} {r['Request Count']:>6} {r['Failure Count']:>6} "
                     f"{_ms(r['Median Response Time']):>10} {_ms(r.get('95%')):>8} {_ms(r.get('99%')):>8} "
                     f"{float(r['Requests/s'] or 0):>7.2f}")
        if r["Name"] != "Aggregated" and r["Type"] != "TTFT":
            total += int(r["Request Count"])
            fails += int(r["Failure Count"])
    return "\n".join(lines), total, fails


def run_locust(args, host: str) -> int:
    os.makedirs(args.out_dir, exist_ok=True)
    prefix = os.path.join(args.out_dir, "locust")
    cmd = [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "--headless", "--host", host,
           "--users", str(args.users), "--spawn-rate", str(args.spawn_rate), "--run-time", args.run_time,
           "--stop-timeout", "30", "--csv", prefix, "--html", os.path.join(args.out_dir, "report.html"),
           "--only-summary", "--loglevel", "WARNING"]
    for flag, value in (("--model-name", args.model_name), ("--api-key", args.api_key),
                        ("--max-prompt-words", args.max_prompt_words),
                        ("--max-output-tokens", args.max_output_tokens)):
        if value:
            cmd += [flag, str(value)]
    bound = parse_run_time(args.run_time) + 30 + 60  # run time + stop timeout + start-up slack
    print(f"locust: {args.users} users, spawn rate {args.spawn_rate}/s, {args.run_time} against {host}", flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, start_new_session=True)
    try:
        proc.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        print(f"locust ran past {bound:.0f}s: stopping it", file=sys.stderr)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if not os.path.exists(f"{prefix}_stats.csv"):
        print(f"locust wrote no statistics (exit code {proc.returncode})", file=sys.stderr)
        return 2
    table, total, fails = summarize(read_stats(prefix))
    ratio = fails / total if total else 1.0
    print("\n" + table)
    print(f"\n{total} requests, {fails} failed (ratio {ratio:.4f}, allowed {args.max_failure_ratio}); "
          f"reports in {args.out_dir}/ (report.html, locust_stats.csv, locust_failures.csv, ...)")
    if total == 0:
        print("no request completed", file=sys.stderr)
        return 1
    return 0 if ratio <= args.max_failure_ratio else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop what we started
    if args.host:
        if not health_ok(args.host):
            print(f"warning: {args.host}/health does not answer 200", file=sys.stderr)
        return run_locust(args, args.host.rstrip("/"))
    cmd = engine_server_cmd(args.model, args.server_arg)
    log = os.path.join(os.path.abspath(args.out_dir), "server.log")
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"starting the server: {' '.join(cmd)}", flush=True)
    with ServerProcess(cmd, startup_timeout=args.startup_timeout, log_path=log, name="engine-server") as server:
        print(f"server healthy at {server.base_url} after {server.startup_s:.1f}s (log: {log})", flush=True)
        return run_locust(args, server.base_url)


if __name__ == "__main__":
    sys.exit(main())
