"""The attention and KV-cache ops the engine calls; the one place a backend is chosen.

`torch` is kernels/reference.py (CPU path and test oracle). The Triton backend is added by the
kernels issue and used for CUDA tensors.
"""

from __future__ import annotations

from kernels import reference

BACKENDS = ("torch",)


def resolve_backend(name: str, device_type: str) -> str:
    """Map an `attention_backend` setting to a usable backend, or say why it cannot be used."""
    if name in ("auto", "torch"):
        return "torch"
    raise ValueError(f"attention_backend {name!r} is not available; use one of {('auto',) + BACKENDS}")


def write_kv(key, value, k_cache, v_cache, slot_mapping, backend: str = "torch") -> None:
    reference.write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                    backend: str = "torch"):
    return reference.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)


def copy_blocks(k_cache, v_cache, src, dst, backend: str = "torch") -> None:
    reference.copy_blocks(k_cache, v_cache, src, dst)
