"""The Triton kernels compile for Hopper and Ampere, checked even where no GPU is present.

The interpreter that runs the other tests on CPU accepts programs the GPU compiler rejects, so
gpu_compile.py builds the real sm_90 and sm_80 binaries of every launch triton_ops makes, and of
every variant its start-up warm-up compiles.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def compile_for_gpu(*args: str) -> None:
    backends = pytest.importorskip("triton.backends")
    if "nvidia" not in backends.backends:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    result = subprocess.run([sys.executable, os.path.join(HERE, "gpu_compile.py"), *args], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]


def test_kernels_compile_for_hopper_and_ampere():
    compile_for_gpu()


def test_no_step_needs_a_binary_the_warmup_did_not_build():
    # Specialisation only, no compiling: batch sizes, block-table widths and metadata alignment
    # must not pick new binaries (do_not_specialize), and the warm-up must cover every tile and
    # split count the launch heuristics choose.
    compile_for_gpu("--check-steps-after-warmup")


@pytest.mark.slow
def test_every_warmup_variant_compiles_for_hopper_and_ampere():
    # Every tile and split count the start-up warm-up compiles for a 1B model at 8k context, and a
    # Qwen3 shape: about 60 binaries, a few minutes on two cores.
    compile_for_gpu("--all-warmup-variants")
