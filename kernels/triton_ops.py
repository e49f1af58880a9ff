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
from kernels.triton_fused import rms_norm_kernel, rotary_write_kv_kernel, silu_and_mul_kernel
from kernels.triton_heuristics import (PREFILL_MIN_AVG_QUERY, TileConfig, next_power_of_2, num_kv_splits,
                                       tile_config)
from kernels.triton_kv_store import write_kv_kernel

# triton.jit builds an interpreted kernel instead of a compiled one when TRITON_INTERPRET=1 was set
# as these modules were imported; only the interpreted kind can take CPU tensors.
INTERPRETED = not isinstance(paged_attention_kernel, JITFunction)
# float32 elements one reduce program holds: 32 per thread at 4 warps, well within registers.
REDUCE_TILE_ELEMENTS = 4096
# A norm row is one tile, up to 128 float32 elements a thread at 16 warps (hidden sizes are <= 16K).
MAX_NORM_HIDDEN = 65536
# Elements of one half-head tile a rotary program holds, and of one SiLU-and-mul program's block.
ROTARY_TILE_ELEMENTS = 1024
SILU_BLOCK = 1024


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


@functools.lru_cache(maxsize=None)
def _smem_bytes(device: torch.device) -> int | None:
    """Shared memory one program may opt into on this GPU (227 KiB on Hopper); None off CUDA."""
    if device.type != "cuda":
        return None
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)


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
                num_splits: int | None = None, config: TileConfig | None = None,
                sliding_window: int | None = None) -> tuple[TileConfig, int]:
    """The tile shape and split count paged_attention uses for these tensors (None = heuristic)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    cfg = config or tile_config(num_tokens, num_seqs, group, next_power_of_2(head_dim), k_cache.element_size(),
                                _smem_bytes(query.device))
    if num_splits is None:
        # block_tables is at least as wide as the longest sequence's blocks: a context bound that
        # needs no sync. A table padded far wider only makes splitting likelier (empty splits exit).
        busy = max(num_seqs, -(-num_tokens // max(cfg.block_m // group, 1))) * num_kv_heads
        context = block_tables.shape[1] * block_size
        if sliding_window is not None:  # a program reads its tile's window, not the whole context
            context = min(context, sliding_window + cfg.block_m // max(group, 1) + cfg.block_n)
        num_splits = num_kv_splits(busy, context, _num_sms(query.device))
    return cfg, num_splits


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, *, out: torch.Tensor | None = None, num_splits: int | None = None,
                    config: TileConfig | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """kernels.reference.paged_attention on Triton. `out`, `num_splits` and `config` override what
    the heuristics choose (tests use them to poison the output and force every path). k_scale /
    v_scale: an fp8 cache's scales, ignored for other caches. sliding_window / logits_soft_cap /
    sinks: the reference's optional features, each compiled in only when given."""
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
    for name, value in (("sliding_window", sliding_window), ("logits_soft_cap", logits_soft_cap)):
        if value is not None and value <= 0:
            raise ValueError(f"paged_attention: {name} must be positive, not {value!r} (None turns it off)")
    if sinks is not None:
        assert sinks.shape == (num_heads,), "sinks: one logit per query head"
        sinks = sinks.to(device=query.device, dtype=torch.float32).contiguous()
    cfg, num_splits = launch_plan(query, k_cache, block_tables, num_seqs, num_splits=num_splits, config=config,
                                  sliding_window=sliding_window)
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
        out if sinks is None else sinks,  # any pointer will do when SINKS is off
        scale * k_scale * math.log2(math.e), num_seqs, sliding_window or 0,
        (logits_soft_cap or 0.0) * math.log2(math.e),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), float(v_scale),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
        BLOCK_M=cfg.block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n, NUM_SPLITS=num_splits,
        # float32 is for tests: keep it exact instead of TF32 on tensor cores.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        WINDOW=sliding_window is not None, SOFT_CAP=logits_soft_cap is not None, SINKS=sinks is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if num_splits > 1:
        # Several heads per program: one head's parts (num_splits x head_dim) are too small a job.
        block_h = min(next_power_of_2(num_heads), max(1, REDUCE_TILE_ELEMENTS // (num_splits * head_dim_pad)))
        split_reduce_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            out, part_out, part_lse, out if sinks is None else sinks, query_start_loc, num_seqs, num_heads,
            out.stride(0), out.stride(1), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_splits,
            BLOCK_H=block_h, SINKS=sinks is not None, num_warps=4)
    return out


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    # Whole-block copies are one gather and one scatter of contiguous blocks; torch's indexing
    # kernels already run them at copy bandwidth, so a Triton kernel would add nothing.
    reference.copy_blocks(k_cache, v_cache, src, dst)


# ---- fused elementwise ops (kernels/triton_fused.py) -------------------------------------------------


def _rows(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(outer, inner, stride_outer, stride_inner): t's rows as a 2-level index, so a [tokens, heads, D]
    view with any token and head strides is read in place."""
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    assert t.dim() == 3, "rms_norm takes [rows, hidden] or [tokens, heads, head_dim]"
    return t.shape[0], t.shape[1], t.stride(0), t.stride(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """kernels.reference.rms_norm in one launch, the residual add fused in: weight * norm(x), or
    (weight * norm(x + residual), x + residual). Outputs are new contiguous tensors."""
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.stride(0) == 1 and x.stride(-1) == 1
    assert hidden <= MAX_NORM_HIDDEN, f"hidden size {hidden} is past one norm tile ({MAX_NORM_HIDDEN})"
    _check_device(x)
    outer, inner, stride_outer, stride_inner = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    has_residual = residual is not None
    if has_residual:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        _, _, stride_r_outer, stride_r_inner = _rows(residual)
    else:
        residual, residual_out, stride_r_outer, stride_r_inner = x, out, 0, 0  # not read or written
    if x.numel() > 0:
        block = next_power_of_2(hidden)
        rms_norm_kernel[(outer * inner,)](
            out, residual_out, x, residual, weight, float(eps), inner, stride_outer, stride_inner,
            stride_r_outer, stride_r_inner, HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=has_residual,
            num_warps=min(16, max(1, block // 256)))
    return (out, residual_out) if has_residual else out


def _rotary(qk, value, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale) -> torch.Tensor:
    num_tokens, num_rotated, head_dim = qk.shape
    assert head_dim % 2 == 0 and cos.shape[-1] == sin.shape[-1] == head_dim // 2
    assert cos.dtype == sin.dtype == qk.dtype, "cos/sin come in the model's dtype (RotaryEmbedding)"
    assert qk.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
    _check_device(qk)
    write = value is not None
    num_kv_heads = value.shape[1] if write else 0
    if write:
        assert value.shape == (num_tokens, num_kv_heads, head_dim) and value.stride(-1) == 1
        assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
        assert k_cache.stride(-1) == v_cache.stride(-1) == 1 and slot_mapping.shape == (num_tokens,)
        if not reference.is_fp8(k_cache.dtype):
            k_scale = v_scale = 1.0
    else:
        value, k_cache, v_cache, slot_mapping = qk, qk, qk, qk  # not read or written
    if num_tokens == 0:
        return qk
    half_pad = next_power_of_2(head_dim // 2)
    heads = num_rotated + num_kv_heads  # [query | key | value] heads, the values only stored
    block_h = min(next_power_of_2(heads), max(1, ROTARY_TILE_ELEMENTS // half_pad))
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)) if write else (0,) * 6
    rotary_write_kv_kernel[(num_tokens, triton.cdiv(heads, block_h))](
        qk, value, cos, sin, k_cache, v_cache, slot_mapping,
        qk.stride(0), qk.stride(1), value.stride(0) if write else 0, value.stride(1) if write else 0,
        cos.stride(0), sin.stride(0), *cache_strides, float(k_scale), float(v_scale),
        NUM_HEADS=num_rotated - num_kv_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2, HALF_PAD=half_pad,
        BLOCK_H=block_h, BLOCK_SIZE=k_cache.shape[1] if write else 1, WRITE_KV=write,
        FP8=write and reference.is_fp8(k_cache.dtype), num_warps=4)
    return qk


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """kernels.reference.apply_rotary, rotating x [tokens, heads, head_dim] in place (it is the
    step's fresh projection output); returns x."""
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        return reference.apply_rotary(x, cos, sin)  # the reference's type promotion, not worth a kernel
    return _rotary(x, None, cos, sin, None, None, None, 1.0, 1.0)


def rotary_write_kv(qk: torch.Tensor, value: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """apply_rotary then write_kv in one launch: qk [tokens, heads + kv_heads, head_dim] (queries,
    then keys) rotated in place, the rotated keys and `value` stored at their slots; returns qk."""
    return _rotary(qk, value, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """kernels.reference.silu_and_mul in one launch: [tokens, 2 * inter] -> [tokens, inter]."""
    assert x.shape[-1] % 2 == 0 and x.stride(-1) == 1
    _check_device(x)
    inter = x.shape[-1] // 2
    rows = x if x.dim() == 2 else x.reshape(-1, 2 * inter)
    out = torch.empty(rows.shape[0], inter, dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        block = min(SILU_BLOCK, next_power_of_2(inter))
        silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            out, rows, rows.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=4)
    return out.view(*x.shape[:-1], inter)


# ---- start-up warm-up --------------------------------------------------------------------------------


def attention_variants(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, max_model_len: int,
                       num_sms: int, kv_bytes: int = 2, smem_bytes: int | None = None) -> list[tuple[TileConfig, int]]:
    """Every (tile, split count) launch_plan can choose for this model: the decode and the prefill
    tile, each with every split count num_kv_splits can return for a table up to max_model_len
    wide. The fewest busy programs (one sequence, num_kv_heads) split the most; every smaller
    power of two is reached by a shorter context."""
    group, head_dim_pad = num_heads // num_kv_heads, next_power_of_2(head_dim)
    tiles = dict.fromkeys((tile_config(1, 1, group, head_dim_pad, kv_bytes, smem_bytes),
                           tile_config(PREFILL_MIN_AVG_QUERY, 1, group, head_dim_pad, kv_bytes, smem_bytes)))
    most = num_kv_splits(num_kv_heads, -(-max_model_len // block_size) * block_size, num_sms)
    return [(tile, 1 << i) for tile in tiles for i in range(most.bit_length())]


def warmup(*, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, max_model_len: int,
           dtype: torch.dtype, device: torch.device | str, kv_cache_dtype: torch.dtype | None = None,
           hidden_size: int | None = None, intermediate_sizes: tuple[int, ...] = (), qk_norm: bool = False,
           index_dtype: torch.dtype = torch.int32, slot_mapping_dtype: torch.dtype = torch.int64,
           attention_features: tuple[tuple[int | None, float | None], ...] = ((None, None),)) -> int:
    """Compile, at start-up, every kernel variant a step of this model can launch, so that no
    request waits on Triton's compiler (about a second a variant) mid-serving: attention at every
    tile and split count (attention_variants), rotary + KV store, and with hidden_size /
    intermediate_sizes (the MLPs' per-rank sizes, MoE experts' too) the norms and SiLU-and-mul.
    Head counts are this rank's. Runs each once on a one-token batch laid out as the model lays
    its tensors out (queries and keys as views of the fused qkv projection, or concatenated after
    Qwen3's q/k norms), so Triton specialises it exactly as it will the real launches; batch sizes
    and metadata alignment are not specialised (do_not_specialize). `attention_features`: each
    (sliding_window, logits_soft_cap) pair the model's layers attend with (each is its own variant).
    Returns the launches made."""
    dev = torch.device(device)
    kv_cache_dtype = kv_cache_dtype or dtype
    launches = 0
    qkv = torch.zeros(1, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, device=dev)
    qk, value = qkv[:, :num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
    if qk_norm:
        head_weight = torch.ones(head_dim, dtype=dtype, device=dev)
        qk = torch.cat([rms_norm(qk[:, :num_heads], head_weight, 1e-6),
                        rms_norm(qk[:, num_heads:], head_weight, 1e-6)], dim=1)
        launches += 2
    cache_shape = (2, block_size, num_kv_heads, head_dim)
    k_cache = torch.zeros(cache_shape, dtype=kv_cache_dtype, device=dev)
    v_cache = torch.zeros(cache_shape, dtype=kv_cache_dtype, device=dev)
    cos = torch.ones(1, 1, head_dim // 2, dtype=dtype, device=dev)
    sin = torch.zeros(1, 1, head_dim // 2, dtype=dtype, device=dev)
    rotary_write_kv(qk, value, cos, sin, k_cache, v_cache, torch.zeros(1, dtype=slot_mapping_dtype, device=dev))
    launches += 1

    block_tables = torch.zeros(1, 1, dtype=index_dtype, device=dev)
    query_start_loc = torch.tensor([0, 1], dtype=index_dtype, device=dev)
    seq_lens = torch.ones(1, dtype=index_dtype, device=dev)
    for tile, num_splits in attention_variants(num_heads, num_kv_heads, head_dim, block_size, max_model_len,
                                               _num_sms(dev), k_cache.element_size(), _smem_bytes(dev)):
        for window, cap in attention_features:
            paged_attention(qk[:, :num_heads], k_cache, v_cache, block_tables, query_start_loc, seq_lens, 1.0,
                            num_splits=num_splits, config=tile, sliding_window=window, logits_soft_cap=cap)
            launches += 1 if num_splits == 1 else 2

    if hidden_size is not None:
        x = torch.zeros(1, hidden_size, dtype=dtype, device=dev)
        weight = torch.ones(hidden_size, dtype=dtype, device=dev)
        rms_norm(x, weight, 1e-6)
        rms_norm(x, weight, 1e-6, x)
        launches += 2
    for inter in intermediate_sizes:
        silu_and_mul(torch.zeros(1, 2 * inter, dtype=dtype, device=dev))
        launches += 1
    return launches
