"""Backend resolution and the Backend objects in kernels/__init__.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import reference, resolve_backend

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_torch_is_always_available():
    assert resolve_backend("torch", "cpu") == "torch"
    assert resolve_backend("torch", "cuda") == "torch"


def test_auto_picks_torch_off_cuda_and_cpu():
    # On CPU, auto is the C++ backend where it builds (tests/kernels/test_cpu_kernels.py).
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


def test_one_backend_object_per_name():
    for name in ("torch", "cpu"):
        ops = kernels.get_backend(name)
        assert ops is kernels.get_backend(name) and ops.name == name
    with pytest.raises(ValueError, match="resolve_backend"):
        kernels.get_backend("auto")


def test_the_torch_backend_is_the_reference():
    ops = kernels.get_backend("torch")
    for op in ("write_kv", "paged_attention", "plan_attention", "copy_blocks", "rms_norm", "apply_rotary",
               "silu_and_mul"):
        assert getattr(ops, op) is getattr(reference, op), op
    w = torch.randn(8, 4)
    assert ops.pack_linear_weight(w) is None
    x = torch.randn(3, 4)
    torch.testing.assert_close(ops.linear(x, w), x @ w.T)


def test_the_triton_backend_object(triton_ops):
    ops = kernels.get_backend("triton")
    assert ops.name == "triton" and ops.write_kv is triton_ops.write_kv
    k, v = ops.allocate_kv_cache(2, 16, 1, 8, torch.float32, "cpu")
    assert k.is_contiguous() and v.is_contiguous() and k.shape == (2, 16, 1, 8)
    assert ops.plan_attention(None, None, None, 16) is None and ops.pack_linear_weight(torch.zeros(2, 2)) is None


def test_compiled_kernels_refuse_cpu_tensors(triton_ops, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-without-interpreter error")
    monkeypatch.setattr(triton_ops, "INTERPRETED", False)
    k_cache = torch.zeros(1, 16, 1, 64)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        triton_ops.write_kv(torch.zeros(1, 1, 64), torch.zeros(1, 1, 64), k_cache, k_cache.clone(),
                            torch.zeros(1, dtype=torch.long))


def test_import_kernels_does_not_import_triton():
    code = ("import sys, kernels; kernels.get_backend('torch'); kernels.get_backend('cpu'); "
            "assert 'triton' not in sys.modules, 'import kernels pulled in triton'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_reference_agrees_across_cache_layouts():
    """The torch backend stores its cache head-major underneath; the reference must give the same
    answer on that layout and on the contiguous one the Triton kernels use."""
    import torch

    from kernels import reference

    torch.manual_seed(0)
    nb, bs, hkv, hq, d = 12, 16, 2, 8, 32
    seq_lens, q_lens = [37, 5, 20, 1], [37, 1, 4, 1]  # a prompt, decodes, a chunk after a cached prefix
    tables = torch.tensor([[0, 1, 2, 0], [3, 0, 0, 0], [4, 5, 0, 0], [6, 0, 0, 0]])
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)))
    outs = []
    for head_major in (False, True):
        alloc = (reference.allocate_kv_cache(nb, bs, hkv, d, torch.float32, torch.device("cpu")) if head_major
                 else torch.zeros(nb, bs, hkv, d))
        k_cache, v_cache = alloc, alloc.clone()
        gen = torch.Generator().manual_seed(1)
        for i, n in enumerate(seq_lens):
            slots = torch.tensor([int(tables[i, p // bs]) * bs + p % bs for p in range(n)])
            reference.write_kv(torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen),
                               k_cache, v_cache, slots)
        query = torch.randn(int(starts[-1]), hq, d, generator=gen)
        outs.append(reference.paged_attention(query, k_cache, v_cache, tables, starts, torch.tensor(seq_lens), 0.2))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
