"""How fast does a command run on CPUs that other work keeps busy? Starts one busy loop per usable CPU
(`python -c "while True: pass"`, the load a shared machine puts beside the engine), runs the command,
stops the loops, and exits with the command's status.

    python benchmarks/threads/beside_busy_loops.py [--loops N] -- engine bench throughput ...

The suite's shared-cpus scenario runs `engine bench throughput` this way, with its default threads
and with --num-threads 1, and quiet (benchmarks/scenarios.toml).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loops", type=int, default=len(os.sched_getaffinity(0)), help="busy loops (default: one per CPU)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command after --")
    if command[0] == "engine":
        command = [sys.executable, "-m", "engine", *command[1:]]
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.loops)]
    try:
        time.sleep(1.0)  # let the scheduler spread the loops before the command starts
        return subprocess.run(command).returncode
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


if __name__ == "__main__":
    sys.exit(main())
