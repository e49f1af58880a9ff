"""Host side of the Triton backend: checks layouts, picks tiles and splits, launches the kernels.

Imported only once the triton backend is chosen (kernels/__init__.py), so `import kernels` never
needs triton. Nothing here reads a value back from the GPU: every choice comes from shapes.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
from triton.runtime.jit import JITFunction

from kernels import reference
from kernels.triton_attention import paged_attention_kernel, split_reduce_kernel
from kernels.triton_heuristics import TileConfig, next_power_of_2, num_kv_splits, tile_config
from kernels.triton_kv_store import write_kv_kernel

# triton.jit builds an interpreted kernel instead of a compiled one when TRITON_INTERPRET=1 was set
# as these modules were imported; only the interpreted kind can take CPU tensors.
INTERPRETED = not isinstance(paged_attention_kernel, JITFunction)
# float32 elements one reduce program holds: 32 per thread at 4 warps, well within registers.
REDUCE_TILE_ELEMENTS = 4096


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not INTERPRETED:
        raise ValueError(
            f"the triton attention backend got {t.device.type} tensors, but its kernels were compiled for "
            "CUDA: set TRITON_INTERPRET=1 before the first import of kernels.triton_ops to run them on CPU, "
            "or use attention_backend='torch'")


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter runs programs one after another: splitting buys nothing there
    return torch.cuda.get_device_properties(device).multi_processor_count


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (num_tokens,)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert key.stride(-1) == value.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    _check_device(key)
    if num_tokens == 0:
        return
    write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), float(k_scale), float(v_scale),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1], FP8=reference.is_fp8(k_cache.dtype),
        num_warps=4)


def launch_plan(query: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, num_seqs: int, *,
                num_splits: int | None = None, config: TileConfig | None = None) -> tuple[TileConfig, int]:
    """The tile shape and split count paged_attention uses for these tensors (None = heuristic)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    cfg = config or tile_config(num_tokens, num_seqs, group, next_power_of_2(head_dim))
    if num_splits is None:
        # block_tables is at least as wide as the longest sequence's blocks: a context bound that
        # needs no sync. A table padded far wider only makes splitting likelier (empty splits exit).
        busy = max(num_seqs, -(-num_tokens // max(cfg.block_m // group, 1))) * num_kv_heads
        num_splits = num_kv_splits(busy, block_tables.shape[1] * block_size, _num_sms(query.device))
    return cfg, num_splits


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, *, out: torch.Tensor | None = None, num_splits: int | None = None,
                    config: TileConfig | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """kernels.reference.paged_attention on Triton. `out`, `num_splits` and `config` override what
    the heuristics choose (tests use them to poison the output and force every path). k_scale /
    v_scale: an fp8 cache's scales, ignored for other caches."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert k_cache.dtype == v_cache.dtype, "K and V caches must share a dtype"
    assert k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape
    assert query_start_loc.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    assert query.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == block_tables.stride(-1) == 1
    _check_device(query)
    if not reference.is_fp8(k_cache.dtype):
        k_scale = v_scale = 1.0
    group = num_heads // num_kv_heads
    head_dim_pad = next_power_of_2(head_dim)
    cfg, num_splits = launch_plan(query, k_cache, block_tables, num_seqs, num_splits=num_splits, config=config)
    block_q = cfg.block_m // group
    assert block_q >= 1, "a tile must hold at least one token's whole head group"
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, "num_splits must be a power of two"
    if num_splits > 1:
        part_out = torch.empty(num_tokens, num_heads, num_splits, head_dim_pad, dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # not read or written without splits; any pointer will do

    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, part_out, part_lse,
        scale * k_scale * math.log2(math.e), num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), float(v_scale),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n, NUM_SPLITS=num_splits,
        # float32 is for tests: keep it exact instead of TF32 on tensor cores.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if num_splits > 1:
        # Several heads per program: one head's parts (num_splits x head_dim) are too small a job.
        block_h = min(next_power_of_2(num_heads), max(1, REDUCE_TILE_ELEMENTS // (num_splits * head_dim_pad)))
        split_reduce_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            out, part_out, part_lse, query_start_loc, num_seqs, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_splits, BLOCK_H=block_h, num_warps=4)
    return out


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    # Whole-block copies are one gather and one scatter of contiguous blocks; torch's indexing
    # kernels already run them at copy bandwidth, so a Triton kernel would add nothing.
    reference.copy_blocks(k_cache, v_cache, src, dst)
