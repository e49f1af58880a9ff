"""CPU threads on shared CPUs (engine/runner/cpu_threads.py): the thread count follows the process's
affinity and cgroup quota, and idle OpenMP threads spin briefly unless the user chose otherwise."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest

from engine.runner.cpu_threads import LoadFollower, cgroup_cpu_limit, runnable_elsewhere, usable_cpus


def _spin_after(code: str, **env) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env
    out = subprocess.run([sys.executable, "-c", code + "; import os; print(os.environ.get('GOMP_SPINCOUNT'))"],
                         env=environ, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_import_engine_first_bounds_the_spin_of_idle_openmp_threads():
    assert _spin_after("import engine") == "10000"


def test_a_setting_the_user_chose_is_kept():
    assert _spin_after("import engine", GOMP_SPINCOUNT="300000") == "300000"
    assert _spin_after("import engine", OMP_WAIT_POLICY="PASSIVE") == "None"  # the policy rules the spin


def test_too_late_once_torch_is_loaded():
    """libgomp has read the settings already: setting one then would only mislead."""
    assert _spin_after("import torch, engine") == "None"


@pytest.mark.parametrize("files, limit", [
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 0.5),
    ({}, None),
])
def test_cgroup_quota_v1_and_v2(tmp_path, files, limit):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_limit(str(tmp_path)) == limit


def test_thread_count_is_affinity_capped_by_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(str(tmp_path)) == affinity  # no quota
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: still one thread
    assert usable_cpus(str(tmp_path)) == 1
    (tmp_path / "cpu.max").write_text(f"{(affinity + 8) * 100000} 100000\n")  # a quota above the mask
    assert usable_cpus(str(tmp_path)) == affinity


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _run(follower, clock, steps: int, step_s, dt: float = 0.125) -> list[int]:
    """`steps` steps of 10 tokens, dt apart; step_s(threads) is how long one takes with that many."""
    used = []
    for _ in range(steps):
        threads = follower.before_step()
        used.append(threads)
        follower.after_step(10, step_s(threads))
        clock.t += dt
    return used


def _follower(others, cpus=2, online=2, binds=None, helpers=None, **kw):
    """helpers: None, a model without the C++ kernels' pool (a float one): the probe; a list, one
    with it (a GGUF): the helper counts set_helpers was given are appended to it."""
    clock, counts = _Clock(), []
    binds = [] if binds is None else binds  # (threads then, one_each) per call
    kw.setdefault("affinity", list(range(cpus)))
    kw.setdefault("kernel_matmuls", helpers is not None)
    follower = LoadFollower(cpus, online=online, sample=lambda: others[0], clock=clock, set_threads=counts.append,
                            interval_s=0.25, window=3, probe_s=1.0, hold_s=5.0,
                            bind=lambda cpus, one_each: binds.append((counts[-1], one_each)),
                            free_caller=lambda cpus: None,  # this test thread's own mask stays
                            set_helpers=helpers.append if helpers is not None else lambda n: None, **kw)
    return follower, clock, counts


def test_a_quiet_machine_keeps_every_cpu_and_never_probes():
    follower, clock, counts = _follower([0])
    assert set(_run(follower, clock, 100, lambda t: 0.05)) == {2} and counts == [2]


@pytest.mark.parametrize("faster, chosen", [(2, 2), (1, 1), (None, 1)])
def test_contended_cpus_probe_both_counts_and_keep_the_faster(faster, chosen):
    # Two busy processes on two CPUs: candidates are all the CPUs (2) and what the others leave (1).
    # Steps alternate between them for the probe, then the faster stays until the next probe; every
    # CPU only when clearly faster (here 1.6x), so a tie keeps the free one.
    follower, clock, counts = _follower([2])
    used = _run(follower, clock, 94, lambda t: 0.05 if t == faster else 0.08)  # a step every 1/8 s
    # Samples at start-up and at the first step (both at 0 s) and at 0.25 s: the window of 3 is full.
    assert used[:2] == [2] * 2
    assert used[2:10] == [2, 1] * 4  # alternating for 1 s
    assert set(used[10:50]) == {chosen}  # held for 5 s
    assert used[50:58] == [2, 1] * 4  # then probed again, which confirms the choice:
    assert set(used[58:94]) == {chosen}  # held for twice as long (the run ends before that)


def test_long_steps_fill_the_window_by_time():
    # Steps of 1 s (prefills under load): the start-up sample and the first step's span more than
    # (window - 1) intervals, so the first step already probes instead of waiting for 3 steps; the
    # probe (1 s) outlasts no step, so it lasts its 3 pairs of neighbours (4 steps), then keeps the faster.
    follower, clock, _ = _follower([2])
    clock.t = 1.0  # the model loaded for a second after the start-up sample
    used = _run(follower, clock, 6, lambda t: 0.5 if t == 1 else 0.8, dt=1.0)
    assert used == [2, 1, 2, 1, 1, 1]


def _prefills(follower, clock, sizes, rate) -> list[int]:
    """Prefill steps of the given token counts, 1 s apart; rate(threads) is their tokens/s, plus a
    fixed 0.05 s a step (the weights streamed once whatever the count)."""
    used = []
    for tokens in sizes:
        threads = follower.before_step("prefill")
        used.append(threads)
        follower.after_step(tokens, 0.05 + tokens / rate(threads))
        clock.t += 1.0
    return used


def test_only_alike_neighbours_are_compared():
    # The probe's first step on every CPU is a prompt's 16-token tail, its step on the free one a
    # 2,048-token chunk: per token the tail is 7x slower, which says nothing of the thread counts
    # (one step each decided this before, the wrong way). Only the next, alike, pairs count.
    follower, clock, _ = _follower([2])
    clock.t = 1.0
    used = _prefills(follower, clock, [16] + [2048] * 6, lambda t: 2000 if t == 2 else 1600)
    assert used == [2, 1, 2, 1, 2, 2, 2]


def test_a_probe_without_alike_steps_gives_up_on_the_free_cpus():
    follower, clock, _ = _follower([2])
    clock.t = 1.0
    used = _prefills(follower, clock, [16, 2048] * 5, lambda t: 2000 if t == 2 else 1600)
    assert used[:6] == [2, 1] * 3 and set(used[6:]) == {1}  # 1 s probe + 4 x 1 s without a pair


def test_prefill_and_decode_steps_choose_apart():
    # Under the same load prefill steps run faster on every CPU and decode steps on the free one
    # (what bf16 on an AVX-512 CPU measured under busy loops): each kind probes its own steps and
    # keeps its own count, and a step runs with its kind's.
    follower, clock, counts = _follower([2])
    used = []
    for i in range(48):
        kind = "prefill" if i % 3 == 0 else "decode"
        threads = follower.before_step(kind)
        used.append((kind, threads))
        follower.after_step(10, 0.05 if threads == (2 if kind == "prefill" else 1) else 0.08)
        clock.t += 0.125
    late = used[16:]  # 2-6 s: past both probes (from 0.25 s, 1 s and a step of each count), within the hold
    assert {t for k, t in late if k == "prefill"} == {2} and {t for k, t in late if k == "decode"} == {1}
    assert counts[-2:] in ([2, 1], [1, 2])  # torch's count follows each step's kind


def test_the_others_leaving_gives_every_cpu_back():
    others = [2]
    follower, clock, counts = _follower(others)
    _run(follower, clock, 20, lambda t: 0.05 if t == 1 else 0.08)
    assert follower.threads == 1
    others[0] = 0
    used = _run(follower, clock, 10, lambda t: 0.05)
    assert used[-1] == 2 and counts[-1] == 2


@pytest.mark.parametrize("faster", [1, 2])
def test_the_log_says_when_cpus_are_given_up_and_back(caplog, faster):
    # A client beside a server makes the others come and go every few seconds: INFO lines only when
    # a kind of step gives up CPUs and when it gets them back, not for every probe.
    others = [2]
    follower, clock, _ = _follower(others)
    with caplog.at_level(logging.INFO, logger="engine.runner.cpu_threads"):
        _run(follower, clock, 20, lambda t: 0.05 if t == faster else 0.08)
        others[0] = 0
        _run(follower, clock, 10, lambda t: 0.05)
    said = [r.getMessage() for r in caplog.records]
    if faster == 1:
        assert said == ["compute threads for decode steps: 1 (with other processes running, alike steps on every "
                        "CPU (2) ran at 0.62x the tokens/s of 1, the median of 7 pairs)",
                        "compute threads 2 again (the other processes left)"]
    else:
        assert said == []


def test_contended_steps_on_every_cpu_bind_a_thread_to_each():
    # Each step on both CPUs beside busy processes binds the team a thread per CPU; a step on one
    # frees them first, while the team is still two (a team of one would not reach the second).
    others, binds = [2], []
    follower, clock, counts = _follower(others, binds=binds)
    used = _run(follower, clock, 10, lambda t: 0.05 if t == 2 else 0.08)
    assert used == [2, 2, 2, 1, 2, 1, 2, 1, 2, 1]  # quiet until the window is full, then the probe
    assert binds == [(2, True), (2, False), (2, True), (2, False), (2, True), (2, False), (2, True), (2, False)]
    others[0] = 0  # quiet again: the window notices within steps, frees the team once, binds no more
    binds.clear()
    _run(follower, clock, 5, lambda t: 0.05)
    assert binds[-1:] in ([], [(2, False)])  # whatever the last probe step was, it ends freed
    binds.clear()
    _run(follower, clock, 20, lambda t: 0.05)
    assert follower.threads == 2 and not follower.bound and binds == []


def test_threads_are_bound_only_while_the_others_keep_every_cpu_busy():
    # Another engine on one of two CPUs leaves the other idle: the probe runs two threads unbound
    # (bound, the prober won at the other engine's cost). Beside two busy loops (every sample of
    # the window sees every CPU taken): bound.
    binds = []
    follower, clock, _ = _follower([1], binds=binds)
    used = _run(follower, clock, 10, lambda t: 0.05 if t == 2 else 0.08)
    assert used[2:10] == [2, 1] * 4 and binds == []
    others = [2]
    follower, clock, _ = _follower(others, binds=binds)
    _run(follower, clock, 12, lambda t: 0.05 if t == 2 else 0.08)  # the probe, then every CPU
    assert binds[:2] == [(2, True), (2, False)]
    # The others' count swinging between crowded and not moves no probe: the choice holds.
    assert follower.threads == 2
    binds.clear()
    for others[0] in [1, 2, 1, 2, 1]:  # within the 5 s hold: 0.5 s each
        assert set(_run(follower, clock, 4, lambda t: 0.05 if t == 2 else 0.08)) == {2}
    assert binds == [(2, False)]  # freed once a sample of the window saw a CPU left idle


def test_no_binding_where_the_count_is_not_the_mask():
    # A quota of 2 CPUs within a mask of 8, all 8 busy: which two to bind to is not the engine's to choose.
    binds = []
    follower, clock, _ = _follower([8], online=8, binds=binds, affinity=list(range(8)))
    assert 1 in _run(follower, clock, 30, lambda t: 0.05) and binds == []


@pytest.mark.parametrize("online", [2, 8])
def test_with_the_kernels_pool_crowded_steps_take_helpers_not_probes(online):
    # A GGUF model beside processes that fill every CPU: torch on one thread, the kernels' loops on
    # it plus a helper for each other CPU, whatever the steps measure (here the team would be faster:
    # no probe runs to find out), never bound; quiet again, the team alone.
    load, helpers, binds = [online], [], []
    follower, clock, counts = _follower(load, cpus=online, online=online, binds=binds, helpers=helpers)
    used = _run(follower, clock, 40, lambda t: 0.05 if t == online else 0.08)
    assert used[:2] == [online] * 2  # until the window is full
    assert set(used[2:]) == {1} and counts[-1] == 1
    assert helpers == [online - 1] and binds == []
    load[0] = 0  # (the window passes through "some CPUs free" on the way: a probe's steps may run)
    used = _run(follower, clock, 20, lambda t: 0.05)
    assert used[-1] == online and counts[-1] == online and helpers[0] == online - 1 and helpers[-1] == 0


@pytest.mark.parametrize("helpers_faster", [True, False])
@pytest.mark.parametrize("others, online, free", [(1, 2, 1), (3, 8, 5)])
def test_with_the_kernels_pool_a_free_cpu_probes_helpers_against_none(others, online, free, helpers_faster):
    # Others leaving CPUs free (one busy loop on two CPUs; a server's bench client): the probe weighs
    # the free CPUs' threads plus helpers for the rest against the free CPUs' threads alone, steps
    # alternating, and keeps the helpers only when clearly faster. Never a team of every CPU.
    load, helpers, binds = [others], [], []
    follower, clock, counts = _follower(load, cpus=online, online=online, binds=binds, helpers=helpers)
    rate = {True: 0.05, False: 0.08} if helpers_faster else {True: 0.08, False: 0.05}
    used, with_helpers = [], []
    for _ in range(40):
        used.append(follower.before_step())
        with_helpers.append(follower.helpers > 0)
        follower.after_step(10, rate[with_helpers[-1]])
        clock.t += 0.125
    assert set(used[2:]) == {free} and binds == []  # torch on the free CPUs throughout
    assert with_helpers[2:10] == [True, False] * 4  # the probe
    assert set(with_helpers[10:]) == {helpers_faster}  # then the faster, held
    assert helpers[:2] == [online - 1, 0]


def test_helpers_join_once_the_runner_says_the_kernels_hold_the_matmuls():
    # The follower starts before the model loads: a probe may begin, and the next contended step
    # after the runner sets kernel_matmuls takes helpers instead.
    helpers = []
    follower, clock, _ = _follower([2], helpers=helpers, kernel_matmuls=False)
    assert _run(follower, clock, 4, lambda t: 0.05)[2:] == [2, 1]  # probing
    follower.kernel_matmuls = True
    assert set(_run(follower, clock, 20, lambda t: 0.05 if t == 2 else 0.08)) == {1} and helpers == [1]


def _masks() -> dict[int, set[int]]:
    return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binds threads to two CPUs")
def test_binding_sets_each_op_threads_cpu_as_the_kernel_reports():
    """The real op and the real follower: the kernel's per-thread masks are the oracle."""
    import torch

    from kernels import cpu_ops

    mask = sorted(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    caller = threading.get_native_id()
    try:
        torch.set_num_threads(2)
        assert cpu_ops.set_thread_cpus(mask[:2], True) == 2
        bound = _masks()
        assert bound[caller] == {mask[0]} and {mask[1]} in bound.values()
        assert cpu_ops.set_thread_cpus(mask, False) == 2
        assert all(m == set(mask) for m in _masks().values())

        follower = LoadFollower(2, online=2, sample=lambda: 2, window=1, affinity=mask[:2])
        assert follower.before_step() == 2  # the probe's first count, bound
        assert os.sched_getaffinity(0) == {mask[0]} and {mask[1]} in _masks().values()
        follower.after_step(1, 0.01)
        assert os.sched_getaffinity(0) == set(mask[:2])  # the caller freed between steps
        assert follower.before_step() == 1  # the probe's second count: the whole team freed
        assert all(m >= set(mask[:2]) for m in _masks().values())
    finally:
        torch.set_num_threads(before)
        os.sched_setaffinity(0, mask)
        cpu_ops.set_thread_cpus(mask, False)


def test_more_cpus_than_the_process_may_use():
    # 8 online CPUs, a quota of 2: the others must keep more than 6 busy before there is anything to probe.
    follower, clock, _ = _follower([6], online=8)
    assert set(_run(follower, clock, 30, lambda t: 0.05)) == {2}
    follower, clock, _ = _follower([7], online=8)
    assert 1 in _run(follower, clock, 30, lambda t: 0.05)


def test_nothing_to_follow_keeps_every_cpu():
    follower, clock, counts = _follower([None], cpus=3, online=3)
    assert set(_run(follower, clock, 30, lambda t: 0.05)) == {3} and counts == [3]


def test_busy_processes_are_counted_and_our_own_threads_are_not():
    assert runnable_elsewhere("/nonexistent") is None
    n = 2
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        import time

        time.sleep(0.5)
        samples = []
        for _ in range(9):
            samples.append(runnable_elsewhere())
            time.sleep(0.02)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert sorted(samples)[4] >= n, samples  # always runnable: running, or queued for a CPU


def test_the_follower_sets_torchs_thread_count():
    import torch

    before = torch.get_num_threads()
    try:
        follower = LoadFollower(2, online=2, sample=lambda: 2, window=1)
        assert torch.get_num_threads() == 2
        assert follower.before_step() == 2
        follower.after_step(1, 0.01)
        assert follower.before_step() == 1 and torch.get_num_threads() == 1  # the probe's second count
    finally:
        torch.set_num_threads(before)


def test_the_follower_gives_the_kernels_pool_its_helpers():
    """The real follower and the real pool: contended, torch's one thread and a helper; quiet, none."""
    import torch

    from kernels import cpu_build

    if cpu_build.available() is not None:
        pytest.skip("the CPU kernels did not build")
    cpu_build.load_quant()
    before, others = torch.get_num_threads(), [2]
    try:
        follower = LoadFollower(2, online=2, sample=lambda: others[0], window=1, interval_s=0.0, kernel_matmuls=True)
        assert follower.before_step() == 1 and torch.get_num_threads() == 1
        assert cpu_build.helpers() == 1 and cpu_build.load_quant().helpers() == 1
        others[0] = 0
        assert follower.before_step() == 2 and torch.get_num_threads() == 2
        assert cpu_build.helpers() == 0 and cpu_build.load_quant().helpers() == 0
    finally:
        cpu_build.set_helpers(0)
        torch.set_num_threads(before)
