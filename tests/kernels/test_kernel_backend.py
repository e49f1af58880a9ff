"""Backend resolution and dispatch in kernels/__init__.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import resolve_backend

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_torch_is_always_available():
    assert resolve_backend("torch", "cpu") == "torch"
    assert resolve_backend("torch", "cuda") == "torch"


def test_auto_picks_torch_off_cuda():
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("auto", "mps") == "torch"


def test_auto_picks_triton_on_cuda():
    pytest.importorskip("triton")
    assert resolve_backend("auto", "cuda") == "triton"


def test_without_triton_auto_falls_back_and_triton_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    assert resolve_backend("auto", "cuda") == "torch"
    with pytest.raises(ValueError, match="install triton or use attention_backend='torch'"):
        resolve_backend("triton", "cuda")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
        resolve_backend("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", "cpu") == "triton"


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown"):
        resolve_backend("cuda", "cuda")
    with pytest.raises(ValueError, match="resolve_backend"):
        kernels.copy_blocks(torch.zeros(1), torch.zeros(1), torch.zeros(0), torch.zeros(0), backend="auto")


def test_compiled_kernels_refuse_cpu_tensors(triton_ops, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-without-interpreter error")
    monkeypatch.setattr(triton_ops, "INTERPRETED", False)
    k_cache = torch.zeros(1, 16, 1, 64)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        triton_ops.write_kv(torch.zeros(1, 1, 64), torch.zeros(1, 1, 64), k_cache, k_cache.clone(),
                            torch.zeros(1, dtype=torch.long))


def test_import_kernels_does_not_import_triton():
    code = "import sys, kernels; assert 'triton' not in sys.modules, 'import kernels pulled in triton'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
