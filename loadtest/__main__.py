"""`python -m loadtest`: start a server, run Locust headless against it, write a report.

    python -m loadtest --users 8 --spawn-rate 2 --run-time 60s --out-dir loadtest-report
    python -m loadtest --host http://10.0.0.5:8000 --users 32 --run-time 5m   # an existing server

Without --host it starts `engine serve` (python -m engine serve) on 127.0.0.1 and a free
port, waits for /health, and stops it (its whole process group) afterwards. Locust runs headless
with a hard time bound; its CSV files, its HTML report, the requests it drew (requests.json) and
the server's log land in --out-dir (relative to the current folder). Prompts are sized in tokens
so that prompt + max_tokens fits the served model's context window (max_model_len from
GET /v1/models): exactly with the served model's tokenizer (--tokenizer; the started server's
own by default), else estimated.

Exit status: 0 when the failure ratio (failed / all requests, TTFT entries excluded) is at most
--max-failure-ratio, 1 when it is above or no request completed, 2 when a setting or a package
is missing or Locust itself failed.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import signal
import subprocess
import sys

PROG = "python -m loadtest"
LOCUSTFILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "locustfile.py")


def fail(message: str):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


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
    from engine.arg_utils import HelpFormatter
    from engine.bench.common import results_path

    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
    g = p.add_argument_group("server")
    g.add_argument("--host", default=None, metavar="URL",
                   help="base URL of a running server (default: start `engine serve` here)")
    g.add_argument("--model", default=None, help="model folder for the started server (default: the embedded one)")
    g.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for the started server, e.g. --server-arg=--max-model-len=1024; it runs "
                        "in the package's folder, so paths in it must be absolute (repeatable; default: none)")
    g.add_argument("--startup-timeout", type=float, default=600.0, metavar="S",
                   help="seconds the started server may take to answer /health")
    g = p.add_argument_group("requests")
    g.add_argument("--model-name", default=None, help="model name in requests (default: the first of GET /v1/models)")
    g.add_argument("--api-key", default=None,
                   help="bearer token (default: $PAGEWISE_API_KEY, else $OPENAI_API_KEY, else none)")
    g.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="the served model's tokenizer folder, for exact prompt sizes (default: the started server's "
                        "model; with --host, none: sizes are estimated at 2 tokens a word)")
    g.add_argument("--max-prompt-tokens", type=int, default=800, metavar="N",
                   help="longest prompt in tokens (also capped by the model's context window)")
    g.add_argument("--max-prompt-words", dest="max_prompt_tokens", type=int, help=argparse.SUPPRESS)  # old name
    g.add_argument("--max-output-tokens", type=int, default=128, metavar="N", help="largest max_tokens asked for")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of the prompt mix: the pool of sized requests, and user i's picks from it (seed + i)")
    g = p.add_argument_group("load and report")
    g.add_argument("--users", type=int, default=8, metavar="N", help="simulated users")
    g.add_argument("--spawn-rate", type=float, default=2.0, metavar="R", help="users started per second")
    g.add_argument("--run-time", default="30s", metavar="T", help="Locust run time, e.g. 30s, 5m, 1h30m")
    g.add_argument("--out-dir", default=results_path("loadtest"), metavar="DIR",
                   help="where the CSV and HTML reports (and the started server's log) go, relative to the current "
                        "folder (default: %(default)s, which git ignores)")
    g.add_argument("--max-failure-ratio", type=float, default=0.01, metavar="R",
                   help="exit 1 above this failed / total ratio; 0 for a strict run")
    return p


def check(args) -> None:
    """Everything the run needs, before a server is started: exit 2 with the fix otherwise."""
    if importlib.util.find_spec("locust") is None:
        fail('the load test needs locust, which is not installed: pip install locust '
             '(or pip install "pagewise[bench]" for every optional package of the benchmarks)')
    try:
        parse_run_time(args.run_time)
    except argparse.ArgumentTypeError as e:
        fail(f"--run-time: {e}")
    if args.tokenizer and not os.path.isdir(args.tokenizer):
        fail(f"--tokenizer {args.tokenizer}: no such folder")
    if args.model and not os.path.exists(args.model):
        fail(f"--model {args.model}: no such folder or file")
    if args.users < 1 or args.max_prompt_tokens < 1 or args.max_output_tokens < 1:
        fail("--users, --max-prompt-tokens and --max-output-tokens must be >= 1")


def served_tokenizer(args) -> str | None:
    """The tokenizer that sizes prompts exactly: --tokenizer, else the started server's model."""
    if args.tokenizer:
        return os.path.abspath(args.tokenizer)
    if args.host:
        return None
    if args.model:
        return os.path.abspath(args.model)
    from engine.loading.default_model import default_model_path

    return default_model_path()


def read_models(host: str, api_key: str | None) -> dict:
    """GET /v1/models ({} when it does not answer: the users then ask it themselves)."""
    import urllib.request

    from engine.bench.backends.openai_http import auth_headers

    try:
        req = urllib.request.Request(host + "/v1/models", headers=auth_headers(api_key))
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r)
    except Exception as e:  # a warning, not a reason to stop
        print(f"warning: GET {host}/v1/models failed ({e}): prompts are not sized to the context window",
              file=sys.stderr)
        return {}


def write_requests(args, host: str, tokenizer: str | None) -> tuple[str, str | None]:
    """Draw the seeded pool of sized requests into OUT_DIR/requests.json; returns (path, model name)."""
    from loadtest.workload import TokenCounter, model_limits, request_pool, save_pool

    model, max_model_len = model_limits(read_models(host, args.api_key))
    tok = None
    if tokenizer:
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    try:
        pool = request_pool(args.seed, TokenCounter(tok), max_model_len, args.max_prompt_tokens,
                            args.max_output_tokens)
    except ValueError as e:
        fail(str(e))
    path = os.path.join(args.out_dir, "requests.json")
    save_pool(path, pool, args.model_name or model, max_model_len, exact=tok is not None)
    sizes = (f"exact ({tokenizer})" if tok is not None else "estimated (no --tokenizer)")
    print(f"model {args.model_name or model}, max_model_len {max_model_len}: prompt sizes {sizes}, "
          f"seed {args.seed}; requests in {path}", flush=True)
    return path, args.model_name or model


def read_stats(prefix: str) -> list[dict]:
    """The run's statistics: the locustfile's final ones (after the drain), else Locust's last CSV."""
    if os.path.exists(f"{prefix}_final.json"):
        with open(f"{prefix}_final.json", encoding="utf-8") as f:
            return json.load(f)
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


def run_locust(args, host: str, tokenizer: str | None) -> int:
    from engine.bench.launch import python_path_env

    out_dir = args.out_dir  # absolute (main): Locust runs in it, and we read its files from anywhere
    os.makedirs(out_dir, exist_ok=True)
    prefix = os.path.join(out_dir, "locust")
    requests_file, model_name = write_requests(args, host, tokenizer)
    if os.path.exists(f"{prefix}_final.json"):  # an earlier run's, in the same folder: never read as this one's
        os.remove(f"{prefix}_final.json")
    cmd = [sys.executable, "-m", "locust", "-f", LOCUSTFILE, "--headless", "--host", host,
           "--users", str(args.users), "--spawn-rate", str(args.spawn_rate), "--run-time", args.run_time,
           "--stop-timeout", "30", "--csv", prefix, "--html", os.path.join(out_dir, "report.html"),
           "--only-summary", "--loglevel", "WARNING", "--seed", str(args.seed), "--requests-file", requests_file,
           "--final-stats", f"{prefix}_final.json"]
    if model_name:
        cmd += ["--model-name", model_name]
    env = python_path_env({"PAGEWISE_API_KEY": args.api_key} if args.api_key else {})  # not on the command line
    bound = parse_run_time(args.run_time) + 30 + 60  # run time + stop timeout + start-up slack
    print(f"locust: {args.users} users, spawn rate {args.spawn_rate}/s, {args.run_time} against {host}", flush=True)
    proc = subprocess.Popen(cmd, cwd=out_dir, env=env, start_new_session=True)
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
    if not os.path.exists(f"{prefix}_final.json") and not os.path.exists(f"{prefix}_stats.csv"):
        print(f"locust wrote no statistics (exit code {proc.returncode})", file=sys.stderr)
        return 2
    table, total, fails = summarize(read_stats(prefix))
    ratio = fails / total if total else 1.0
    print("\n" + table)
    print(f"\n{total} requests, {fails} failed (ratio {ratio:.4f}, allowed {args.max_failure_ratio}); "
          f"reports in {out_dir}/ (report.html, locust_stats.csv, locust_failures.csv, requests.json, ...)")
    if total == 0:
        print("no request completed", file=sys.stderr)
        return 1
    return 0 if ratio <= args.max_failure_ratio else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check(args)
    args.out_dir = os.path.abspath(args.out_dir)  # relative to where the user stands, not to this package
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop what we started
    from engine.bench.launch import ServerProcess, engine_server_cmd, health_ok

    try:
        tokenizer = served_tokenizer(args)
    except (ImportError, OSError) as e:  # the default model's package is missing or damaged
        fail(str(e))
    if args.host:
        if not health_ok(args.host):
            print(f"warning: {args.host}/health does not answer 200", file=sys.stderr)
        return run_locust(args, args.host.rstrip("/"), tokenizer)
    model = os.path.abspath(args.model) if args.model else None
    cmd = engine_server_cmd(model, args.server_arg)
    os.makedirs(args.out_dir, exist_ok=True)
    log = os.path.join(args.out_dir, "server.log")
    print(f"starting the server: {' '.join(cmd)}", flush=True)
    with ServerProcess(cmd, startup_timeout=args.startup_timeout, log_path=log, name="engine-server") as server:
        print(f"server healthy at {server.base_url} after {server.startup_s:.1f}s (log: {log})", flush=True)
        return run_locust(args, server.base_url, tokenizer)


if __name__ == "__main__":
    sys.exit(main())
