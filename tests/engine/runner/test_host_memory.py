"""engine/runner/host_memory.py: glibc takes the malloc settings the CPU engine runs with (their effect
on step time is a benchmark, BENCHMARKS.md, not a test)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_glibc_accepts_the_settings_once_per_process():
    # A fresh process: the settings are process-wide. mallopt answers 0 for a value it refuses.
    code = ("from engine.runner.host_memory import keep_freed_memory\n"
            "assert keep_freed_memory(), 'glibc refused a setting'\n"
            "assert keep_freed_memory(), 'a second call must not undo the first'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
