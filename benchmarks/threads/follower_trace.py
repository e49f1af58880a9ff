"""`engine bench throughput` on the default model's Q4_1 file (64 x 128/128) with the thread
follower traced: its choices (DEBUG lines of engine.runner.cpu_threads) and, per kind of step and thread
count, the steps, tokens and step seconds it ran, printed to stderr at exit. Run it beside busy
loops (or another engine) to see what the follower chose and what each choice got.

    python benchmarks/threads/follower_trace.py OUT.json [--choose every|one] [--no-bind]

--choose forces every probe's outcome (every: every CPU, bound; one: one thread) so the two can
be compared on the same machine state; --no-bind leaves every-CPU steps unbound. Run it from the
checkout to trace (PYTHONPATH=that checkout).
"""

from __future__ import annotations

import argparse
import atexit
import logging
import sys
import time
from collections import defaultdict

import engine.runner.cpu_threads as cpu_threads
from engine.cli import main
from engine.loading.default_model import default_gguf_path


def _trace_steps() -> list[tuple[str, str, int, float]]:
    steps: list[tuple[str, str, int, float]] = []  # kind, how it ran, tokens, seconds
    after_step = cpu_threads.LoadFollower.after_step

    def traced(self, tokens, seconds):
        kind = next(k for k, c in self.choices.items() if c is self.running)
        how = f"{self.threads} threads" + (f" + {self.helpers} helpers" if getattr(self, "helpers", 0) else "")
        how += ", crowded" if self.crowded else ""
        steps.append((kind, how, tokens, seconds))
        after_step(self, tokens, seconds)

    cpu_threads.LoadFollower.after_step = traced
    return steps


def _report(steps) -> None:
    totals = defaultdict(lambda: [0, 0, 0.0])
    for kind, threads, tokens, seconds in steps:
        t = totals[(kind, threads)]
        t[0], t[1], t[2] = t[0] + 1, t[1] + tokens, t[2] + seconds
    for (kind, how), (n, tokens, seconds) in sorted(totals.items()):
        print(f"{kind:8s} {how:32s}: {n:4d} steps {tokens:6d} tokens {seconds:6.2f} s "
              f"{tokens / seconds:7.0f} tok/s", file=sys.stderr)


def run() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--choose", choices=["every", "one"])
    parser.add_argument("--no-bind", action="store_true")
    args = parser.parse_args()
    if args.choose:
        cpu_threads.CLEARLY_FASTER = 0.0 if args.choose == "every" else float("inf")
    if args.no_bind:
        cpu_threads._bind_team = cpu_threads._bind_nothing
    logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)7.0f ms %(message)s")
    logging.getLogger("engine.runner.cpu_threads").setLevel(logging.DEBUG)
    steps = _trace_steps()
    atexit.register(_report, steps)
    started = time.monotonic()
    code = main(["bench", "throughput", "--backend", "engine", "--model", default_gguf_path(), "--num-prompts", "64",
                 "--input-len", "128", "--output-len", "128", "--disable-tqdm", "--output-json", args.out])
    print(f"wall {time.monotonic() - started:.1f} s", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(run())
