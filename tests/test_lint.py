"""The code passes the ruff configuration in pyproject.toml ([tool.ruff]: pycodestyle errors and
warnings, pyflakes, 120 columns). ruff is in the [test] extra, so CI runs this; it is skipped only
where ruff is not installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_check_passes():
    pytest.importorskip("ruff")
    # --no-cache: leave nothing behind in the checkout (.ruff_cache).
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", ROOT],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"ruff check failed:\n{result.stdout}{result.stderr}"
