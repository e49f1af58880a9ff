"""How long does `engine serve` take from launch to /health 200: the first start in a Python
environment (the C++ kernels compiled, into a fresh extension folder) and a later one (built
kernels loaded)? Writes {"cold start s": ..., "warm start s": ...} to --out.

    python benchmarks/start-up/serve_start.py --out start.json [-- engine serve flags]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def start_once(extensions: str, flags: list[str], log_path: str) -> float:
    """Seconds from launching `engine serve` to its first /health 200; then stops it."""
    port = free_port()
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=extensions)
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--port", str(port), *flags],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while not healthy(port):
                if proc.poll() is not None:
                    raise SystemExit(f"engine serve exited with {proc.returncode}: see {log_path}")
                if time.perf_counter() - start > TIMEOUT_S:
                    raise SystemExit(f"no /health 200 within {TIMEOUT_S} s: see {log_path}")
                time.sleep(0.2)
            return time.perf_counter() - start
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSON file written")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="after --: more engine serve flags")
    args = p.parse_args()
    flags = [f for f in args.flags if f != "--"]
    with tempfile.TemporaryDirectory(prefix="pagewise-start-") as extensions:
        log = os.path.splitext(args.out)[0]
        cold = start_once(extensions, flags, log + "-cold.log")
        warm = start_once(extensions, flags, log + "-warm.log")
    values = {"cold start s": round(cold, 1), "warm start s": round(warm, 1)}
    with open(args.out, "w") as f:
        json.dump(values, f)
    print(json.dumps(values))


if __name__ == "__main__":
    main()
