"""CPU threads on shared CPUs (engine/cpu_threads.py): the thread count follows the process's
affinity and cgroup quota, and idle OpenMP threads spin briefly unless the user chose otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.cpu_threads import cgroup_cpu_limit, usable_cpus


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
