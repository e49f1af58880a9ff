"""Every tool that writes a report puts it, unless told otherwise, under one folder the repository
ignores, so that running an example from a checkout leaves nothing for git to pick up."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from engine.bench.common import RESULTS_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("argv, default", [
    (["-m", "loadtest"], f"{RESULTS_DIR}/loadtest"),
    (["-m", "loadtest.soak"], f"{RESULTS_DIR}/soak"),
    (["-m", "engine.bench.gpu_check"], f"{RESULTS_DIR}/gpu-check"),
    (["-m", "engine", "bench", "serve"], f"./{RESULTS_DIR}"),
    (["-m", "engine", "bench", "suite"], f"./{RESULTS_DIR}"),
])
def test_reports_default_to_the_ignored_folder(argv, default):
    done = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    help_text = re.sub(r"(?<=\w-)\s+", "", re.sub(r"\s+", " ", done.stdout))  # argparse wraps at a hyphen
    assert f"default: {default}" in help_text, help_text[-2000:]


def test_git_ignores_the_folder():
    if not os.path.isdir(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "check-ignore", "-q", f"{RESULTS_DIR}/loadtest/report.html"], cwd=ROOT)
    assert done.returncode == 0
