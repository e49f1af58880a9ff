"""Where the CPU kernels are built: a folder per Python environment, so that another virtual
environment on the same machine (its own torch headers, its own build commands) never rebuilds
over this one's libraries."""

from __future__ import annotations

import os
import subprocess
import sys

from kernels import cpu_build

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _build_root(python: str) -> str:
    code = "from kernels import cpu_build; print(cpu_build._build_root())"
    return subprocess.run([python, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def test_another_environment_builds_in_a_folder_of_its_own(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(tmp_path / "env")],
                   check=True)
    other = _build_root(str(tmp_path / "env" / "bin" / "python"))
    ours = _build_root(sys.executable)
    assert ours == str(cpu_build._build_root())
    assert other != ours and os.path.dirname(other) == os.path.dirname(ours)


def test_the_libraries_this_process_loaded_live_in_its_folder():
    ops, quant = cpu_build.load(), cpu_build.load_quant()
    for module in (ops, quant):
        assert os.path.dirname(os.path.dirname(module.__file__)) == str(cpu_build._build_root())
