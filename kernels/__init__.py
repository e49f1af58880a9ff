"""The attention and KV-cache ops the engine calls; the one place a backend is chosen.

Backends:
  torch   kernels/reference.py: the CPU path and the test oracle (also runs on CUDA, slowly).
  triton  kernels/triton_*.py: the CUDA path. On CPU tensors it runs only under Triton's
          interpreter (TRITON_INTERPRET=1 set before the kernels are imported), for tests.

Triton is imported lazily, only once the triton backend is resolved or used, so `import kernels`
stays light (triton takes a quarter of a second to import) and works where triton is missing.
"""

from __future__ import annotations

import importlib
import os

from kernels import reference

BACKENDS = ("torch", "triton")
# What triton itself reads as "on" for its boolean environment variables.
_TRUE = ("1", "true", "on")


def _triton_import_error() -> ImportError | None:
    try:
        importlib.import_module("triton")
    except ImportError as e:
        return e
    return None


def resolve_backend(name: str, device_type: str) -> str:
    """Map an `attention_backend` setting ("auto" | "torch" | "triton") to a usable backend, or
    raise ValueError saying what to change."""
    if name not in ("auto",) + BACKENDS:
        raise ValueError(f"attention_backend {name!r} is unknown; use one of {('auto',) + BACKENDS}")
    if name == "torch" or (name == "auto" and device_type != "cuda"):
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
    """The module implementing `backend`; triton_ops is imported on first use."""
    if backend == "torch":
        return reference
    if backend == "triton":
        from kernels import triton_ops
        return triton_ops
    raise ValueError(f"backend {backend!r} is not one of {BACKENDS}; pass what resolve_backend() returned")


def write_kv(key, value, k_cache, v_cache, slot_mapping, backend: str = "torch") -> None:
    """Store each new token's key and value at its slot in the paged cache; slot -1 = padding."""
    _ops(backend).write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                    backend: str = "torch", plan=None):
    """Causal attention of each sequence's new queries over its cached keys and values.
    `plan` (torch backend): reference.plan_attention's per-step batch layout, shared by all layers."""
    if backend == "torch":
        return reference.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                         plan=plan)
    return _ops(backend).paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)


def plan_attention(block_tables, query_start_loc, seq_lens, block_size: int, backend: str = "torch"):
    """Per-step work shared by every layer's attention call; None where the backend needs none."""
    if backend == "torch":
        return reference.plan_attention(block_tables, query_start_loc, seq_lens, block_size)
    return None


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, device,
                      backend: str = "torch"):
    """A zeroed cache of logical shape [num_blocks, block_size, num_kv_heads, head_dim]. Its memory
    layout is the backend's choice: contiguous for Triton, head-major underneath for torch."""
    if backend == "torch":
        return reference.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    import torch

    return torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)


def copy_blocks(k_cache, v_cache, src, dst, backend: str = "torch") -> None:
    """Copy whole cache blocks src[i] -> dst[i] (copy-on-write of a shared partial block)."""
    _ops(backend).copy_blocks(k_cache, v_cache, src, dst)
