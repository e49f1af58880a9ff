"""`python -m loadtest.soak`: a long load test that watches the server's memory.

    python -m loadtest.soak --run-time 10m --users 16 --out-dir soak-report

Starts `engine serve` on 127.0.0.1 (a free port), runs `python -m loadtest` against it, and
samples the server's resident memory (VmRSS, its worker processes included) every few seconds.
RSS growth is measured from the end of the warm-up (--warmup, by default the first minute: caches,
allocator pools and compiled kernels fill up there) to the end of the run. It writes rss.csv,
rss.png (with matplotlib) and the load test's report to --out-dir, checks that no KV block is
left in use, and exits 1 when the growth is above --max-rss-growth or the load test failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from loadtest.__main__ import parse_run_time

PROG = "python -m loadtest.soak"


def rss_bytes(pid: int) -> int:
    """VmRSS of a process and its descendants (data-parallel replicas, TP workers)."""
    total = 0
    for p in [pid, *_descendants(pid)]:
        try:
            with open(f"/proc/{p}/status") as f:
                m = re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M)
            total += int(m.group(1)) * 1024 if m else 0
        except OSError:
            pass  # ended meanwhile
    return total


def _descendants(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return []
    return children + [d for c in children for d in _descendants(c)]


def start_server(args, log_path: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "engine", "serve", "--port", "0", *args.server_arg]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        with open(log_path) as f:
            m = re.search(r"pagewise listening on (http://[\d.]+:\d+)", f.read())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"{PROG}: error: the server exited with {proc.returncode}; see {log_path}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"{PROG}: error: the server did not start in {args.startup_timeout:.0f}s; see {log_path}")


def used_kv_blocks(url: str) -> float | None:
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(r"^pagewise:num_used_kv_blocks\{[^}]*\}\s+(\S+)", text, re.M)
    return float(m.group(1)) if m else None


def plot(samples: list[tuple[float, int]], warmup: float, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([t / 60 for t, _ in samples], [r / 2**20 for _, r in samples])
    ax.axvline(warmup / 60, color="grey", linestyle="--", label="end of warm-up")
    ax.set_xlabel("minutes")
    ax.set_ylabel("server RSS (MiB)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    from engine.arg_utils import HelpFormatter
    from engine.bench.common import results_path

    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter, allow_abbrev=False)
    p.add_argument("--run-time", type=parse_run_time, default=600.0, metavar="T", help="load duration (e.g. 10m)")
    p.add_argument("--warmup", type=parse_run_time, default=60.0, metavar="T",
                   help="RSS growth is measured from here to the end")
    p.add_argument("--users", type=int, default=16, help="concurrent simulated users")
    p.add_argument("--spawn-rate", type=float, default=4.0, help="users started per second")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--max-rss-growth", type=float, default=0.05, help="largest growth accepted (a fraction)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `engine serve` (repeatable; default: none)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds the server may take to start")
    p.add_argument("--out-dir", default=results_path("soak"),
                   help="where the report goes, relative to here (default: %(default)s, which git ignores)")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out_dir)
    os.makedirs(out, exist_ok=True)

    server, url = start_server(args, os.path.join(out, "server.log"))
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    start = time.monotonic()

    def sample():
        while not stop.is_set():
            samples.append((time.monotonic() - start, rss_bytes(server.pid)))
            stop.wait(args.interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        load = subprocess.run([sys.executable, "-m", "loadtest", "--host", url, "--users", str(args.users),
                               "--spawn-rate", str(args.spawn_rate), "--run-time", f"{args.run_time:.0f}s",
                               "--out-dir", os.path.join(out, "load")])
        time.sleep(2 * args.interval)  # the last requests end; their memory is returned
        blocks = used_kv_blocks(url)
    finally:
        stop.set()
        sampler.join()
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
    after_warmup = next(r for t, r in samples if t >= args.warmup)
    growth = samples[-1][1] / after_warmup - 1
    with open(os.path.join(out, "rss.csv"), "w") as f:
        f.write("seconds,rss_bytes\n" + "".join(f"{t:.1f},{r}\n" for t, r in samples))
    plot(samples, args.warmup, os.path.join(out, "rss.png"))
    result = {"run_time_s": args.run_time, "users": args.users, "rss_after_warmup_mib": after_warmup / 2**20,
              "rss_end_mib": samples[-1][1] / 2**20, "rss_growth": growth, "kv_blocks_in_use_after": blocks,
              "load_test_exit": load.returncode}
    with open(os.path.join(out, "soak.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return 0 if load.returncode == 0 and growth <= args.max_rss_growth and blocks == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
