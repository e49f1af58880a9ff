"""CPU threads that hold up when the CPUs are shared.

Two decisions, both about other processes on the same CPUs (a container's quota, a shared host,
a test run beside a server):

- How many compute threads: the CPUs this process may really use, the smaller of its affinity
  mask and its cgroup CPU quota, not `os.cpu_count()` (the host's). A quota of 2 CPUs on a
  64-core host would otherwise start 64 threads that take turns on 2 CPUs.
- How long idle threads spin: torch's OpenMP runtime (libgomp) lets a thread that reaches the end
  of a parallel region spin before it sleeps, 300,000 iterations by default. On a quiet machine
  that saves a wake-up; on a shared one the spinning thread burns the CPU time the thread it waits
  for needs. Measured here (BENCHMARKS.md, "Threads on shared CPUs"; default model, bf16,
  64 x 128/128): two engines side by side on 2 CPUs fell from ~1,000 to 92 output tok/s each with
  the default spin, ran at ~340 each with 10,000 spins and at ~550 with none
  (OMP_WAIT_POLICY=PASSIVE); but sleeping at once cost a quiet machine 28% (965 -> 695), and 10,000
  spins cost it nothing measurable (967 vs 942-1,010). So the engine bounds the spin to
  GOMP_SPINCOUNT=10000, unless the user set a wait policy or a spin count. libgomp reads these once,
  when torch loads it, so this must run before torch is imported: `import engine` does it; a
  program that imported torch first keeps torch's default (logged once, with what to do).

- How many of those to use right now (LoadFollower): bounding the spin did not close the gap. Two
  threads on two CPUs, each CPU time-shared with another process, still wait on each other at the
  end of every parallel region, a scheduler time slice at a time, so under one busy loop per CPU
  the engine kept 0.37-0.46x of its quiet throughput and at times less than one thread gets.
  So with the default thread count the engine looks, a few times a second between steps, at how
  many threads of other processes are runnable (the kernel's count of running tasks less this
  process's own). While they leave CPUs idle it uses them all; while they keep some busy it
  measures, step by step, whether all the CPUs or only the ones they leave free process more tokens
  per second, and keeps the free ones only when clearly better (neither wins everywhere:
  LoadFollower says when each did). BENCHMARKS.md (session 8, "Threads on shared CPUs") has the
  numbers.

Neither the spin nor the following is an EngineConfig knob: the thread count is (`num_threads`: a
number fixes it, the default follows the load within the usable CPUs), and the spin is OpenMP's own
standard setting, which a user may set either way.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections import deque

logger = logging.getLogger(__name__)

WAIT_POLICY, SPIN_COUNT = "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"
BOUNDED_SPINS = "10000"
_told = False


def bound_openmp_spinning(environ=os.environ) -> None:
    """Set GOMP_SPINCOUNT=10000 for this process (and the workers it starts, which inherit it)
    when nobody chose a wait policy or spin count and torch's OpenMP runtime has not read them yet."""
    if WAIT_POLICY not in environ and SPIN_COUNT not in environ and "torch" not in sys.modules:
        environ[SPIN_COUNT] = BOUNDED_SPINS


def check_openmp_spin() -> None:
    """Log once when this process's OpenMP threads spin at length because torch was imported
    before engine (the setting can no longer change), so a user on shared CPUs knows the fix."""
    global _told
    if _told or WAIT_POLICY in os.environ or SPIN_COUNT in os.environ:
        return
    _told = True
    logger.info("torch was imported before engine, so its idle OpenMP threads spin for long; on CPUs shared with "
                "other processes set GOMP_SPINCOUNT=10000 (or OMP_WAIT_POLICY=PASSIVE) before starting Python")


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> float | None:
    """The CPU quota of this process's cgroup in CPUs (cgroup v2 `cpu.max`, or v1's CFS quota
    and period), None when there is none."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cpus(root: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may run on: its affinity mask, capped by its cgroup quota (rounded up:
    a 2.5-CPU quota still gains from a third thread part of the time)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cpus = min(cpus, max(1, math.ceil(limit)))
    return max(1, cpus)


def runnable_elsewhere(proc: str = "/proc") -> int | None:
    """Threads of other processes runnable at this instant (running or waiting for a CPU): the
    kernel's count of running tasks (/proc/loadavg) less this process's own threads in state R
    (the reader, and OpenMP workers still spinning). None where /proc does not tell (not Linux)."""
    try:
        with open(os.path.join(proc, "loadavg")) as f:
            running = int(f.read().split()[3].split("/")[0])
        ours = 0
        task_dir = os.path.join(proc, "self", "task")
        for tid in os.listdir(task_dir):
            try:
                with open(os.path.join(task_dir, tid, "stat"), "rb") as f:
                    stat = f.read()
            except OSError:  # the thread ended between the listing and the read
                continue
            state_at = stat.rindex(b")") + 2  # after "pid (comm) ", whatever the thread's name holds
            ours += stat[state_at:state_at + 1] == b"R"
    except (OSError, ValueError, IndexError):
        return None
    return max(0, running - ours)


# How much faster the smaller thread count must measure before the follower keeps it (see below).
CLEARLY_FASTER = 1.1


class LoadFollower:
    """The compute thread count on CPUs that other processes share, within `cpus` (usable_cpus()).

    before_step() and after_step() bracket every step, on the thread that runs the forward (torch's
    thread count is that thread's OpenMP setting). At most every `interval_s`, before_step samples
    runnable_elsewhere(); the mean of the last `window` samples, rounded, is the CPUs the others
    take from the machine's `online` ones, and what they leave, `free` (at least 1), is a candidate.
    Quiet (free >= cpus): every usable CPU. Contended, which of `cpus` and `free` threads is better
    depends on the work and on the others: measured with one busy loop per CPU, 64 x 128/128 kept
    more output with 2 threads (each time-sharing a CPU: more of the machine, minus the waits at
    every parallel region) than with 1, while two engines side by side each did better with 1 (the
    CPUs split between them, no waits). So the follower measures instead of guessing: for `probe_s`
    seconds the steps alternate between the candidates (neighbouring steps are alike, so each sees
    the same mix of prefill and decode), then it keeps the smaller count only if it processed
    CLEARLY_FASTER times the tokens per second of step time, else every CPU, and probes again after
    `hold_s` seconds or when the candidates change. Why "clearly": under busy loops the probes read
    the two counts as even, give or take 15% either way (1 thread 76-106 tok/s, 2 threads 75-130),
    where a sustained run with one thread kept 15% less; between two engines they read one thread
    1.15-1.3x faster, and one thread each kept 20-24% more. A sample costs ~0.2 ms (a /proc read
    per thread of this process): at 5 a second, 0.1% of a CPU."""

    def __init__(self, cpus: int, *, online: int | None = None, interval_s: float = 0.2, window: int = 5,
                 probe_s: float = 2.0, hold_s: float = 20.0, sample=runnable_elsewhere, clock=time.monotonic,
                 set_threads=None):
        import torch

        self.cpus = cpus
        self.online = online or os.cpu_count() or cpus
        self.interval_s, self.probe_s, self.hold_s = interval_s, probe_s, hold_s
        self.samples: deque[int] = deque(maxlen=window)
        self.sample, self.clock = sample, clock
        self.set_threads = set_threads or torch.set_num_threads
        self.threads = cpus
        self.next_sample_at = 0.0
        self.candidates: tuple[int, ...] = (cpus,)
        self.trials: dict[int, list[float]] = {}  # threads -> [tokens, step seconds] while probing
        self.probes = 0  # steps run in the current probe: they alternate over the candidates
        self.phase_ends = 0.0  # the current probe's, or the current choice's hold
        self.set_threads(cpus)

    def _use(self, threads: int, why: str, level: int = logging.INFO) -> None:
        if threads != self.threads:
            logger.log(level, "compute threads %d -> %d (%s)", self.threads, threads, why)
            self.threads = threads
            self.set_threads(threads)

    def before_step(self) -> int:
        """Resample when due, move the probe on; the thread count for this step."""
        now = self.clock()
        if now >= self.next_sample_at:
            self.next_sample_at = now + self.interval_s
            others = self.sample()
            if others is not None:
                self.samples.append(others)
            if len(self.samples) == self.samples.maxlen:  # before that: too few samples to act on
                load = math.floor(sum(self.samples) / len(self.samples) + 0.5)
                free = max(1, min(self.cpus, self.online - load))
                candidates = (self.cpus,) if free >= self.cpus else (self.cpus, free)
                if candidates != self.candidates:
                    self.candidates, self.trials = candidates, {}
                    if len(candidates) == 1:
                        self._use(self.cpus, "the other processes left")
                    else:
                        logger.debug("other processes keep ~%d of %d CPUs busy", load, self.online)
                        self.phase_ends = now  # probe from this step on
        if len(self.candidates) > 1:
            if now >= self.phase_ends:
                if self.trials:
                    self._choose(now)
                else:  # start a probe
                    self.trials = {c: [0.0, 0.0] for c in self.candidates}
                    self.probes = 0
                    self.phase_ends = now + self.probe_s
            if self.trials:
                self._use(self.candidates[self.probes % len(self.candidates)], "probing", logging.DEBUG)
                self.probes += 1
        return self.threads

    def after_step(self, tokens: int, seconds: float) -> None:
        """Credit a finished step to the thread count it ran with, while probing."""
        if self.threads in self.trials:
            trial = self.trials[self.threads]
            trial[0] += tokens
            trial[1] += seconds

    def _choose(self, now: float) -> None:
        rates = {c: tokens / seconds for c, (tokens, seconds) in self.trials.items() if seconds > 0}
        self.trials = {}
        self.phase_ends = now + self.hold_s
        if len(rates) < len(self.candidates):  # a probe without steps of each: keep every usable CPU
            self._use(self.cpus, "no steps to compare")
            return
        fewest = min(rates)
        pick = fewest if rates[fewest] >= CLEARLY_FASTER * rates[self.cpus] else self.cpus
        self._use(pick, "measured with other processes running: " +
                  ", ".join(f"{c} threads {r:.0f} tok/s" for c, r in sorted(rates.items())))
