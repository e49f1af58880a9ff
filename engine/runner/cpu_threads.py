"""CPU threads that hold up when the CPUs are shared.

Two decisions, both about other processes on the same CPUs (a container's quota, a shared host,
a test run beside a server):

- How many compute threads: the CPUs this process may really use, the smaller of its affinity
  mask and its cgroup CPU quota, not `os.cpu_count()` (the host's). A quota of 2 CPUs on a
  64-core host would otherwise start 64 threads that take turns on 2 CPUs.
- How long idle threads spin: torch's OpenMP runtime (libgomp) lets a thread that reaches the end
  of a parallel region spin before it sleeps, 300,000 iterations by default. On a quiet machine
  that saves a wake-up; on a shared one the spinning thread burns the CPU time the thread it waits
  for needs: with the default spin two engines side by side on 2 CPUs fell to a tenth of their
  rate, while sleeping at once costs a quiet machine over a quarter and 10,000 spins cost it
  nothing measurable (BENCHMARKS.md, "Threads on shared CPUs"). So the engine bounds the spin to
  GOMP_SPINCOUNT=10000, unless the user set a wait policy or a spin count. libgomp reads these once,
  when torch loads it, so this must run before torch is imported: `import engine` does it; a
  program that imported torch first keeps torch's default (logged once, with what to do).

- How many of those to use right now (LoadFollower): bounding the spin did not close the gap. Two
  threads on two CPUs, each CPU time-shared with another process, still wait on each other at the
  end of every parallel region, a scheduler time slice at a time, so under one busy loop per CPU
  the engine kept 0.37-0.46x of its quiet throughput and at times less than one thread gets.
  So with the default thread count the engine looks, a few times a second between steps, at how
  many threads of other processes are runnable (the kernel's count of running tasks less this
  process's own). While they leave every usable CPU idle it uses them all; while they keep some
  busy it measures, step by step and for prefill and decode steps apart, whether all the CPUs or
  only the ones they leave free process more tokens per second, and keeps all only when clearly
  better (neither wins everywhere: LoadFollower says when each did).
- Where those threads run: while the others keep every CPU busy, a step on all of them binds a
  thread to each CPU, because unbound threads at times ran a third as fast for seconds as the
  scheduler placed them (BENCHMARKS.md, "Threads on shared CPUs").
- Helpers instead of a bound team, where the engine's C++ kernels do the matmuls (a GGUF or
  int8/int4 model, or bf16 weights widened in them): while the others keep every CPU busy, torch
  runs on one thread and the kernels' loops on it plus helpers for the other CPUs, which their
  caller never waits for (cpu_build.set_helpers): a helper the scheduler has not run takes no
  chunk, where an OpenMP team's join waits for its slowest thread. No probe is needed there, since
  the probe's own steps on the wrong count were its cost (BENCHMARKS.md, "Threads on shared CPUs").
  While they leave a CPU free, the helpers are what the probe weighs against the free CPUs alone.

Neither the spin nor the following is an EngineConfig knob: the thread count is (`num_threads`: a
number fixes it, the default follows the load within the usable CPUs), and the spin is OpenMP's own
standard setting, which a user may set either way.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
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


def _affinity() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no masks to set either
        return []


def _bind_team(cpus: list[int], one_each: bool) -> None:
    from kernels import cpu_ops

    cpu_ops.set_thread_cpus(cpus, one_each)


def _set_kernel_helpers(n: int) -> None:
    from kernels import cpu_build

    cpu_build.set_helpers(n)


def _bind_nothing(cpus: list[int], one_each: bool) -> None:
    pass


def _free_caller(cpus: list[int]) -> None:
    os.sched_setaffinity(0, cpus)  # 0: the calling thread alone (Linux's per-thread masks)


# How much faster every usable CPU must measure before the follower keeps them over
# the ones the others leave free (see below).
CLEARLY_FASTER = 1.1
# The longest hold between probes, in base holds (hold_s): 8 x 20 s.
MAX_HOLDS = 8
# Neighbouring steps compare only when their token counts are within this ratio (see LoadFollower).
ALIKE = 1.25
# A probe decides on the median of this many alike pairs (one pair's ratio under busy loops read
# anywhere from 0.6x to 1.8x), or on what it has this many probe_s past its end (none: the free ones).
MIN_PAIRS = 3
GIVE_UP_PROBES = 4
# Steps the follower chooses for apart: any prompt chunk in the step, or decode rows only.
STEP_KINDS = ("prefill", "decode")


class _Choice:
    """One kind of step's thread count while other processes keep CPUs busy: its probe and its hold."""

    def __init__(self, threads: int, now: float, hold_s: float):
        self.threads = threads  # what steps of this kind run with now
        self.probing = False  # a probe is under way: steps alternate, alike pairs are compared
        self.probes = 0  # steps run in the current probe: they alternate over the candidates
        self.last: tuple[int, int, float] | None = None  # the probe's last step: threads, tokens, tok/s
        self.ratios: list[float] = []  # per pair of alike neighbours: every CPU's tok/s over the free ones'
        self.phase_ends = now  # the current probe's, or the current choice's hold
        self.hold = hold_s  # the current choice's hold: doubles while probes keep confirming it
        self.chosen: int | None = None  # the last probe's choice


class LoadFollower:
    """The compute thread count on CPUs that other processes share, within `cpus` (usable_cpus()).

    before_step(kind) and after_step() bracket every step, on the thread that runs the forward
    (torch's thread count is that thread's OpenMP setting). before_step samples runnable_elsewhere()
    at most every `interval_s` (and once at construction, while the model loads); the mean of the
    last `window` samples, rounded, is the CPUs the others take from the machine's `online` ones.
    A window also counts as full once its samples span (window - 1) intervals: a 2,048-token
    prefill under busy loops takes ~1.3 s, one sample each, and the first five steps otherwise ran
    on every CPU before the follower could act.

    Quiet (the others leave every usable CPU idle): all of them. Crowded (below), where the matmuls
    run in the C++ kernels (kernel_matmuls): torch on one thread and the kernels' loops on it plus
    `cpus` - 1 helpers, with no probe (the module docstring). Otherwise contended, the probe below
    chooses between every CPU and the free ones, where for kernel_matmuls "every CPU" means the free
    CPUs' torch threads plus those helpers (see before_step). Contended, which is better, `cpus`
    threads or `free` (what the others leave, at least 1; when every sample of the window saw them
    leave none, the `cpus` threads run bound, one to each CPU: _use), depends on the work, the CPU
    and the others. Nor is the count the others take an exact measure: a benchmark client that is
    runnable a small part of the time reads as a CPU taken most of it. So the follower measures, and
    for prefill steps (any prompt chunk) and decode steps apart, because the two can prefer
    different counts and a choice made on one held the other on the wrong one. For `probe_s`
    seconds a kind's steps alternate between the candidates; each two neighbouring steps whose token
    counts are ALIKE (a 2,048-token prompt chunk and its 16-token tail are not, nor a lone warm-up
    row and 16 decode rows: such pairs decided whole runs before, at 3x the wrong way) give a ratio
    of the two counts' tokens per second of step time. Once the probe's time is up and it has
    MIN_PAIRS ratios, it keeps every CPU only if the median ratio is CLEARLY_FASTER, else the free
    ones, and probes again after a hold of `hold_s` seconds, doubled (up to MAX_HOLDS times) each
    time a probe confirms the last choice, or when the candidates change.

    Why the free ones in a tie: threads that time-share a CPU with another process are the gamble;
    one thread keeps its fair share run after run, while two swing with the others' time slices,
    even bound. A sample costs ~0.2 ms (a /proc read per thread of this process): at 5 a second,
    0.1% of a CPU."""

    def __init__(self, cpus: int, *, online: int | None = None, interval_s: float = 0.2, window: int = 5,
                 probe_s: float = 2.0, hold_s: float = 20.0, sample=runnable_elsewhere, clock=time.monotonic,
                 set_threads=None, bind=None, free_caller=None, affinity: list[int] | None = None,
                 set_helpers=None, kernel_matmuls: bool = False):
        import torch

        self.cpus = cpus
        # Contended steps on every CPU of the mask run a thread per CPU (see _use).
        self.affinity = sorted(affinity if affinity is not None else _affinity())
        self.bind = bind or _bind_team
        self.free_caller = free_caller or _free_caller
        self.bound = False
        self.said_fewer = False  # a probe's choice of fewer threads was logged: say when they are back
        self.online = online or os.cpu_count() or cpus
        self.interval_s, self.probe_s, self.hold_s = interval_s, probe_s, hold_s
        self.samples: deque[tuple[float, int]] = deque(maxlen=window)  # (when, runnable_elsewhere())
        self.sample, self.clock = sample, clock
        self.set_threads = set_threads or torch.set_num_threads
        self.set_helpers = set_helpers or _set_kernel_helpers
        # The model's matmuls run in the engine's C++ kernels (block-format weights on the cpu
        # backend), whose loops helpers can join: the runner says so once the model is loaded.
        self.kernel_matmuls = kernel_matmuls
        self.helpers = 0  # the kernels' helper threads beside torch's (see before_step)
        self.helped = False  # this step runs with helpers, crowded: no probe credits it
        self.ran = cpus  # the candidate (a count of CPUs) this step runs with
        self.threads = cpus
        self.candidates: tuple[int, ...] = (cpus,)
        self.crowded = False  # the others keep every CPU busy: every-CPU steps bind (see _use)
        start = self.clock()
        self._fresh_choices(start)
        self.running = self.choices["decode"]  # the kind of the step under way
        self.set_threads(cpus)
        self._sample(start)
        self.next_sample_at = start  # and another at the first step, however soon

    def _fresh_choices(self, now: float) -> None:
        """Every kind starts over on every CPU, and probes from its next step on when there is a choice."""
        self.choices = {kind: _Choice(self.cpus, now, self.hold_s) for kind in STEP_KINDS}

    def _sample(self, now: float) -> None:
        self.next_sample_at = now + self.interval_s
        others = self.sample()
        if others is not None:
            self.samples.append((now, others))

    def _window_full(self, now: float) -> bool:
        if len(self.samples) == self.samples.maxlen:
            return True
        return len(self.samples) > 1 and now - self.samples[0][0] >= (self.samples.maxlen - 1) * self.interval_s

    def _use(self, threads: int) -> None:
        # While the others keep every CPU busy, a step on every CPU of the mask binds a thread to
        # each, because unbound the scheduler's placement can hold two threads to a third of the
        # speed for seconds. Not while they leave a CPU idle: there, binding wins only at the cost
        # of the other process (of two engines side by side, the one that bound starved the other).
        # One thread stays unbound: moving between CPUs is how it gets its fair share.
        bind = threads > 1 and self.crowded and threads == len(self.affinity)
        if self.bound and not bind:
            self._bind(False)  # before the team shrinks, so every thread bound is freed
        if threads != self.threads:
            self.threads = threads
            self.set_threads(threads)
        if bind:
            self._bind(True)  # every step: a thread the team gained since is bound too

    def _set_helpers(self, helpers: int) -> None:
        if helpers != self.helpers:
            self.helpers = helpers
            self.set_helpers(helpers)

    def _bind(self, one_each: bool) -> None:
        try:
            self.bind(self.affinity, one_each)
            self.bound = one_each
        except Exception as e:  # the CPU kernels could not be built: threads stay where they are
            logger.info("compute threads left unbound on shared CPUs (%s)", e)
            self.bind, self.bound = _bind_nothing, False

    def before_step(self, kind: str = "decode") -> int:
        """Resample when due, move this kind's probe on; the thread count for this step.
        kind: "prefill" (the step holds a prompt chunk) or "decode"."""
        now = self.clock()
        if now >= self.next_sample_at:
            self._sample(now)
            if self._window_full(now):  # before that: too few samples to act on
                load = math.floor(sum(others for _, others in self.samples) / len(self.samples) + 0.5)
                left = self.online - load  # CPUs the others leave idle
                candidates = (self.cpus,) if left >= self.cpus else (self.cpus, max(1, left))
                # Crowded: every sample of the window saw the others fill every CPU, as CPU-bound
                # work does (busy loops, a compile); another engine's threads sleep between its
                # steps and at its barriers. Binding beat one thread beside the first and, beside
                # the second, won for the prober at the neighbour's cost (see _use). Crowded or not
                # changes only where the threads run, not the probe: beside another engine the count
                # swings with its probes, and restarting ours at each swing put half of every few
                # seconds' steps on the slower count.
                self.crowded = min(others for _, others in self.samples) >= self.online
                if candidates != self.candidates:
                    self.candidates = candidates
                    self._fresh_choices(now)
                    if candidates == (self.cpus,):
                        logger.log(logging.INFO if self.said_fewer else logging.DEBUG,
                                   "compute threads %d again (the other processes left)", self.cpus)
                        self.said_fewer = False
                    else:
                        logger.debug("other processes keep ~%d of %d CPUs busy", load, self.online)
        choice = self.running = self.choices[kind]
        # Crowded, with the C++ kernels doing the matmuls: every CPU as below (torch on one thread,
        # the kernels' loops on it plus a helper for every other CPU, taken only when the scheduler
        # runs them), no probe (the module docstring says why).
        self.helped = self.crowded and len(self.candidates) > 1 and self.kernel_matmuls
        if len(self.candidates) > 1 and not self.helped:
            if now >= choice.phase_ends:
                if choice.probing:
                    # With steps longer than the probe (prefills under load), it ends after
                    # MIN_PAIRS pairs.
                    if len(choice.ratios) >= MIN_PAIRS or now >= choice.phase_ends + GIVE_UP_PROBES * self.probe_s:
                        self._choose(kind, choice, now)
                else:  # start a probe
                    choice.probing, choice.probes, choice.last, choice.ratios = True, 0, None, []
                    choice.phase_ends = now + self.probe_s
            if choice.probing:
                choice.threads = self.candidates[choice.probes % len(self.candidates)]
                choice.probes += 1
        self.ran = self.cpus if self.helped else choice.threads
        if self.kernel_matmuls and len(self.candidates) > 1 and self.ran == self.cpus:
            # "Every CPU" for the kernels' matmuls: the free CPUs' threads plus a helper for each other
            # CPU. Probed against the free ones alone, as the team is for torch's GEMMs: beside one
            # busy loop on two CPUs the helper, time-shared with it, held its chunks through the
            # loop's time slices (0.86-0.89x one thread), while beside a server's bench client it
            # takes the CPU the client leaves idle most of the time.
            self._set_helpers(self.cpus - 1)
            self._use(self.candidates[-1])
        else:
            self._set_helpers(0)
            self._use(choice.threads)
        return self.threads

    def after_step(self, tokens: int, seconds: float) -> None:
        """Credit a finished step to the thread count it ran with, while its kind is probing."""
        if self.bound:
            # The calling thread is the team's first: freed between steps, so threads it starts
            # (a tokenizer's pool, a server's) do not inherit one CPU. Its team mates stay bound.
            self.free_caller(self.affinity)
        choice = self.running
        if self.helped or not choice.probing or tokens <= 0 or seconds <= 0:
            return
        step = (self.ran, tokens, tokens / seconds)
        last = choice.last
        if last is not None and last[0] != step[0] and max(tokens, last[1]) <= ALIKE * min(tokens, last[1]):
            every, free = (step, last) if step[0] == self.cpus else (last, step)
            choice.ratios.append(every[2] / free[2])
        choice.last = step

    def _choose(self, kind: str, choice: _Choice, now: float) -> None:
        choice.probing = False
        fewest = min(self.candidates)
        # No alike pair at all: nothing says every CPU is faster, so the free ones.
        ratio = statistics.median(choice.ratios) if choice.ratios else 0.0
        pick = self.cpus if ratio >= CLEARLY_FASTER else fewest
        # Half of every probe's steps run on the count that lost: a probe that confirms the choice
        # doubles the next hold (up to MAX_HOLDS base holds), a changed choice starts again.
        confirmed = pick == choice.chosen
        choice.hold = min(2 * choice.hold, MAX_HOLDS * self.hold_s) if confirmed else self.hold_s
        choice.chosen, choice.threads, choice.phase_ends = pick, pick, now + choice.hold
        # Said when a kind gives up CPUs (a client beside a server makes the others come and go
        # every few seconds, each time with a probe: a line for each would flood the log).
        said = pick != self.cpus and not confirmed
        self.said_fewer |= said
        logger.log(logging.INFO if said else logging.DEBUG,
                   "compute threads for %s steps: %d (with other processes running, alike steps on every CPU (%d%s) "
                   "ran at %.2fx the tokens/s of %d, the median of %d pairs)", kind, pick, self.cpus,
                   ", the kernels' helpers beside the free ones" if self.kernel_matmuls else "", ratio, fewest,
                   len(choice.ratios))
