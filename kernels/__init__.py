"""The attention, KV-cache and fused elementwise ops the engine calls; the one place a backend is
chosen.

Backends:
  torch   kernels/reference.py: pure torch, the test oracle, and the fallback on any device.
  cpu     kernels/cpu_ops.py: C++ kernels (kernels/cpu_ops.cpp, compiled on first use) for CPU
          paged attention, the KV store and the fused norm / rotary / SwiGLU, and oneDNN
          matmuls on prepacked weights. The default on CPU when a C++ compiler is there.
  triton  kernels/triton_*.py: the CUDA path. On CPU tensors it runs only under Triton's
          interpreter (TRITON_INTERPRET=1 set before the kernels are imported), for tests.

Triton and the C++ build are reached lazily, only once their backend is resolved or used, so
`import kernels` stays light and works where either is missing.
"""

from __future__ import annotations

import importlib
import logging
import os

import torch
import torch.nn.functional as F

from kernels import reference

logger = logging.getLogger(__name__)

BACKENDS = ("torch", "cpu", "triton")
# What triton itself reads as "on" for its boolean environment variables.
_TRUE = ("1", "true", "on")


def _triton_import_error() -> ImportError | None:
    try:
        importlib.import_module("triton")
    except ImportError as e:
        return e
    return None


def _cpu_error() -> Exception | None:
    from kernels import cpu_build

    return cpu_build.available()


def resolve_backend(name: str, device_type: str) -> str:
    """Map an `attention_backend` setting ("auto" | "torch" | "cpu" | "triton") to a usable
    backend, or raise ValueError saying what to change."""
    if name not in ("auto",) + BACKENDS:
        raise ValueError(f"attention_backend {name!r} is unknown; use one of {('auto',) + BACKENDS}")
    if name == "torch":
        return "torch"
    if name == "cpu" or (name == "auto" and device_type == "cpu"):
        if device_type != "cpu":
            raise ValueError(f"attention_backend 'cpu' runs on the CPU device, not {device_type!r}; "
                             "use attention_backend='auto'")
        error = _cpu_error()
        if error is None:
            return "cpu"
        if name == "cpu":
            raise ValueError(f"attention_backend 'cpu' needs its C++ kernels, which failed to build ({error}); "
                             "install a C++ compiler (g++) or use attention_backend='torch'")
        logger.warning("CPU kernels unavailable (%s); using the slower pure-torch backend", error)
        return "torch"
    if name == "auto" and device_type != "cuda":
        return "torch"
    error = _triton_import_error()
    if name == "auto":
        return "torch" if error is not None else "triton"
    if error is not None:
        raise ValueError(f"attention_backend 'triton' needs the triton package, which failed to import "
                         f"({error}); install triton or use attention_backend='torch'")
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET", "").lower() not in _TRUE:
        raise ValueError(f"attention_backend 'triton' on {device_type!r} runs only under Triton's interpreter: "
                         "set TRITON_INTERPRET=1 in the environment before starting (slow; for tests), "
                         "or use attention_backend='torch'")
    return "triton"


def _ops(backend: str):
    """The module implementing `backend`; triton_ops and cpu_ops are imported on first use."""
    if backend == "torch":
        return reference
    if backend == "cpu":
        from kernels import cpu_ops
        return cpu_ops
    if backend == "triton":
        from kernels import triton_ops
        return triton_ops
    raise ValueError(f"backend {backend!r} is not one of {BACKENDS}; pass what resolve_backend() returned")


def _elementwise(backend: str):
    """Norm / rotary / SwiGLU: C++ on the cpu backend, torch elsewhere (on CUDA these are a few
    fused torch kernels each, next to matmuls that dominate)."""
    return _ops("cpu") if backend == "cpu" else reference


def write_kv(key, value, k_cache, v_cache, slot_mapping, backend: str = "torch") -> None:
    """Store each new token's key and value at its slot in the paged cache; slot -1 = padding."""
    _ops(backend).write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                    backend: str = "torch", plan=None):
    """Causal attention of each sequence's new queries over its cached keys and values.
    `plan` (torch and cpu backends): plan_attention's per-step batch layout, shared by all layers."""
    if backend in ("torch", "cpu"):
        return _ops(backend).paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                             scale, plan=plan)
    return _ops(backend).paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)


def plan_attention(block_tables, query_start_loc, seq_lens, block_size: int, backend: str = "torch"):
    """Per-step work shared by every layer's attention call; None where the backend needs none."""
    if backend in ("torch", "cpu"):
        return _ops(backend).plan_attention(block_tables, query_start_loc, seq_lens, block_size)
    return None


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device,
                      backend: str = "torch"):
    """(k_cache, v_cache), zeroed, each of logical shape [num_blocks, block_size, num_kv_heads,
    head_dim]. Their memory layout is the backend's choice: contiguous for Triton, head-major
    underneath for torch, keys transposed within blocks for cpu."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if backend == "cpu":
        return _ops("cpu").allocate_kv_cache(*shape, dtype, device)
    if backend == "torch":
        return tuple(reference.allocate_kv_cache(*shape, dtype, device) for _ in range(2))
    return tuple(torch.zeros(*shape, dtype=dtype, device=device) for _ in range(2))


def copy_blocks(k_cache, v_cache, src, dst, backend: str = "torch") -> None:
    """Copy whole cache blocks src[i] -> dst[i] (copy-on-write of a shared partial block)."""
    _ops(backend).copy_blocks(k_cache, v_cache, src, dst)


def rms_norm(x, weight, eps: float, residual=None, backend: str = "torch"):
    """Without residual: weight * norm(x). With residual: (weight * norm(x + residual), x + residual)."""
    return _elementwise(backend).rms_norm(x, weight, eps, residual)


def apply_rotary(x, cos, sin, backend: str = "torch"):
    """Rotary embedding of x [tokens, heads, head_dim] by cos/sin [tokens, 1, head_dim / 2];
    may rotate x in place (cpu backend): use the returned tensor."""
    return _elementwise(backend).apply_rotary(x, cos, sin)


def silu_and_mul(x, backend: str = "torch"):
    """[tokens, 2 * inter] = [gate | up] -> silu(gate) * up."""
    return _elementwise(backend).silu_and_mul(x)


def pack_linear_weight(weight, backend: str = "torch"):
    """A copy of a linear weight in the layout the backend's matmul wants (cpu: oneDNN's blocked
    layout), or None where the plain weight is best. Hand it back to linear()."""
    return _ops("cpu").pack_linear_weight(weight) if backend == "cpu" else None


def linear(x, weight, bias=None, packed=None):
    """x @ weight.T + bias, through `packed` when pack_linear_weight made one."""
    if packed is not None:
        return _ops("cpu").linear(x, packed, bias)
    return F.linear(x, weight, bias)
