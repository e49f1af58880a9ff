"""The CPU backend: kernels/cpu_ops.cpp (built on first use by kernels/cpu_build.py) for decode
attention, the KV store and the fused elementwise ops; the reference's SDPA for prefill chunks,
which are matmul-bound and which CPU's flash kernel already does well.

Cache layout: keys transposed within each block (kernels/cpu_ops.cpp says why), values as rows.
Both tensors are handed out as the reference's logical [num_blocks, block_size, num_kv_heads,
head_dim] views, so every logical consumer (prefill gathers, copy_blocks, tests) reads them as it
reads any other cache.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.cpu_build import load

plan_attention = reference.plan_attention
copy_blocks = reference.copy_blocks


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.zeros(num_kv_heads, num_blocks, head_dim, block_size, dtype=dtype, device=device)
    v = torch.zeros(num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=device)
    return k.permute(1, 3, 0, 2), v.permute(1, 2, 0, 3)


def _physical(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = k_cache.permute(2, 0, 3, 1), v_cache.permute(2, 0, 1, 3)
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("the cpu backend's caches come from kernels.allocate_kv_cache(..., backend='cpu')")
    return k, v


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    load().write_kv(key.to(k_cache.dtype), value.to(v_cache.dtype), *_physical(k_cache, v_cache), slot_mapping)


def paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                    plan: reference.AttentionPlan | None = None) -> torch.Tensor:
    plan = plan or plan_attention(block_tables, query_start_loc, seq_lens, k_cache.shape[1])
    k, v = _physical(k_cache, v_cache)
    if query.dtype != k.dtype:  # a kv_cache_dtype unlike the model's: the reference converts
        return reference.paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                         plan=plan)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if plan.decode_rows is not None:
        load().decode_attention(out, query, k, v, plan.decode_tables, plan.decode_lens, plan.decode_rows, scale)
    reference.prefill_attention(query, k_cache, v_cache, plan.prefills, scale, out)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    outs = load().rms_norm(x.contiguous(), None if residual is None else residual.contiguous(), weight, eps)
    return outs[0] if residual is None else (outs[0], outs[1])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x in place (it is this step's fresh projection output) and returns it."""
    load().rotary_(x, cos.reshape(x.shape[0], -1).contiguous(), sin.reshape(x.shape[0], -1).contiguous())
    return x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return load().silu_and_mul(x.contiguous())
