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

Neither is an EngineConfig knob: the thread count is (`num_threads`, whose default this computes),
and the spin is OpenMP's own standard setting, which a user may set either way.
"""

from __future__ import annotations

import logging
import math
import os
import sys

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
