"""The CPU backend: kernels/cpu_ops.cpp (built on first use by kernels/cpu_build.py) for paged
attention, the KV store, the fused elementwise ops and the fused mixture-of-experts layer, and
oneDNN matmuls on prepacked weights.

Attention: every query row of a step, decode or prefill, is one work item reading its sequence's
blocks in place (a prefill row causally, up to its own position). `python -m kernels.cpu_bench`
measures each op against the reference (BENCHMARKS.md).

Cache layout: keys transposed within each block (kernels/cpu_ops.cpp says why), values as rows.
Both tensors are handed out as the reference's logical [num_blocks, block_size, num_kv_heads,
head_dim] views, so every logical consumer (copy_blocks, tests) reads them as any other cache.
An fp8 (e4m3) cache is quantized by write_kv and read by the attention's inner loops as e4m3 *
scale, as kernels/reference.py defines them; a bfloat16 / float16 cache under a float32 model
likewise (rounded to nearest even as written, widened as read): half a float32 cache's bytes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels import cpu_quant, reference
from kernels.cpu_build import load

logger = logging.getLogger(__name__)

copy_blocks = reference.copy_blocks


@dataclass
class RowPlan:
    """Per query row of a step: which sequence's block table it reads, and how many keys."""

    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    row_seq: torch.Tensor  # [num_tokens] int64
    lens: torch.Tensor  # [num_tokens] int64: the row's position + 1


def plan_attention(block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                   block_size: int) -> RowPlan:
    return RowPlan(*load().plan_rows(block_tables, query_start_loc, seq_lens))


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


def narrow_cache(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """A bfloat16 / float16 cache under a float32 model: the C++ kernels convert as they write and read."""
    return query_dtype == torch.float32 and cache_dtype in (torch.bfloat16, torch.float16)


def write_kv(key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    if not reference.is_fp8(k_cache.dtype) and not narrow_cache(key.dtype, k_cache.dtype):
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)  # fp8 and 16-bit caches convert in C++
    load().write_kv(key, value, *_physical(k_cache, v_cache), slot_mapping, k_scale, v_scale)


def paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                    plan: RowPlan | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of `query` past the step's last sequence are padding (padded_num_tokens): zeros out.
    A sliding window skips the blocks wholly before it (they are neither read nor checked)."""
    k, v = _physical(k_cache, v_cache)
    plan = plan or plan_attention(block_tables, query_start_loc, seq_lens, k_cache.shape[1])
    rows = plan.row_seq.numel()
    if query.dtype != k.dtype and not reference.is_fp8(k.dtype) and not narrow_cache(query.dtype, k.dtype):
        # Other mixed dtypes (a float32 cache under a 16-bit model): the reference converts.
        out = reference.paged_attention(query[:rows], k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks)
        return torch.cat([out, out.new_zeros(query.shape[0] - rows, *out.shape[1:])]) if rows < query.shape[0] else out
    for name, value in (("sliding_window", sliding_window), ("logits_soft_cap", logits_soft_cap)):
        if value is not None and value <= 0:
            raise ValueError(f"paged_attention: {name} must be positive, not {value!r} (None turns it off)")
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    load().paged_attention(out, query, k, v, plan.block_tables, plan.row_seq, plan.lens, scale, k_scale, v_scale,
                           sliding_window or 0, logits_soft_cap or 0.0, sinks)
    if rows < out.shape[0]:
        out[rows:].zero_()
    return out


native_bf16_matmul = cpu_quant.native_bf16_matmul  # its home is beside the block kernels that ask it


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight [out, in] in oneDNN's blocked layout, reordered once at load instead of on every
    call, or None where oneDNN cannot take it. Measured here at 64 rows against F.linear: bf16
    1.2-1.5x, float32 2-3x (F.linear's float32 path is MKL's sgemm)."""
    if not torch.backends.mkldnn.is_available() or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if weight.dtype == torch.bfloat16 and not native_bf16_matmul():
        return None  # no native bf16 (an AVX2-only CPU): oneDNN refuses to pack, F.linear still runs
    try:  # torch's private op (inductor's CPU freezing packs weights with it): absent, use F.linear
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 64)
    except (AttributeError, RuntimeError) as e:
        logger.warning("oneDNN weight packing unavailable (%s); matmuls use F.linear", e)
        return None


def padded_num_tokens(n: int) -> int:
    """The rows to run a step of n tokens as: n up to 16, above that n rounded up to one of eight
    sizes per power of two (at most 1/8 more rows; 88 sizes up to 8,192). oneDNN keeps state for
    every matmul shape it has run, outside its bounded plan cache: RSS grows with every new row
    count, and by nothing once the counts come from a fixed set. A server's steps come in every
    token count, so unpadded it grew for as long as it served.
    Padding the step once, at its input, costs less than padding each matmul (a copy each)."""
    if n <= 16:
        return n
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


linear = cpu_quant.onednn_linear  # x by a pack_linear_weight result; one home with the block kernels' GEMM


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    outs = load().rms_norm(x.contiguous(), None if residual is None else residual.contiguous(), weight, eps)
    return outs[0] if residual is None else (outs[0], outs[1])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x in place (it is this step's fresh projection output) and returns it."""
    load().rotary_(x, cos.reshape(x.shape[0], -1).contiguous(), sin.reshape(x.shape[0], -1).contiguous())
    return x


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place; skips the 32-token words a grammar allows whole (reference.apply_token_bitmask)."""
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        return reference.apply_token_bitmask(logits, bitmask)
    load().apply_token_bitmask_(logits, bitmask.contiguous())


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> int64 [B]: reference.argmax's answer (first maximum, NaN first) in one pass at
    memory speed, where torch's reduction crawls through 16-bit rows."""
    return load().argmax_rows(logits.contiguous())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return load().silu_and_mul(x.contiguous())


select_experts = reference.select_experts  # routing is a softmax and a top-k: torch's own kernels


MOE_LAYOUTS = ("auto", "brgemm", "matmul", "blocks")


def pack_moe_weights(w13: torch.Tensor, w2: torch.Tensor, layout: str = "auto"):
    """bfloat16: the experts' weights packed once, one PackedExperts (the caller may then free w13
    and w2: fused_moe reads only the packed copy). layout "brgemm": VNNI tiles for oneDNN's brgemm
    microkernel (needs AMX and an even hidden size and ffn); "matmul": each expert's w13 [2F, H] and
    w2 [H, F] in oneDNN's blocked layout; "blocks": each expert's bf16 rows as stored, read as
    cpu_quant's BF16 blocks (hidden size and ffn whole blocks of 32) and widened to float32 in its
    kernels; "auto": brgemm where it runs, else matmul where bf16 is native, else blocks where the
    shapes allow, else matmul. None for other dtypes, whose plain stacked weights measure as fast or
    faster (kernels/cpu_ops.cpp, "mixture of experts")."""
    if layout not in MOE_LAYOUTS:
        raise ValueError(f"pack_moe_weights: layout must be one of {MOE_LAYOUTS}, not {layout!r}")
    if w13.dtype != torch.bfloat16:
        return None
    lib = load()
    if layout in ("auto", "brgemm") and lib.moe_brgemm_available() and w13.shape[2] % 2 == 0 and w2.shape[2] % 2 == 0:
        return lib.pack_moe_brgemm(w13.detach(), w2.detach())
    if layout == "brgemm":
        raise ValueError("pack_moe_weights: the brgemm layout needs AMX and an even hidden size and ffn")
    whole_blocks = w13.shape[2] % cpu_quant.FORMATS["BF16"].block_weights == 0 and \
        w2.shape[2] % cpu_quant.FORMATS["BF16"].block_weights == 0
    if layout == "blocks" and not whole_blocks:
        raise ValueError("pack_moe_weights: the blocks layout needs a hidden size and ffn of whole blocks of 32")
    if layout == "blocks" or (layout == "auto" and whole_blocks and not native_bf16_matmul()):
        return _pack_moe_blocks(w13, w2)
    packs = [pack_linear_weight(w) for stacked in (w13, w2) for w in stacked]
    if not packs or any(p is None for p in packs):
        return None
    return lib.PackedExperts(packs[:len(w13)], packs[len(w13):], w13.shape[2], w2.shape[2])


def _pack_moe_blocks(w13: torch.Tensor, w2: torch.Tensor):
    """Each expert's bf16 rows viewed as BF16 blocks (the same bytes: the views keep the storage)."""
    quant = cpu_quant.load_quant()
    return load().pack_moe_blocks([w.detach().contiguous().view(torch.uint8) for w in w13],
                                  [w.detach().contiguous().view(torch.uint8) for w in w2], w13.shape[2], w2.shape[2],
                                  cpu_quant.FORMATS["BF16"].id, cpu_quant.DEQUANT_GEMM_ROWS,
                                  quant.linear_f32_address(), quant.linear_f32_tiled_address())


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, expert_offset: int = 0, packed=None) -> torch.Tensor:
    """kernels.reference.fused_moe in one C++ call: tokens sorted by expert, gate/up and down matmuls
    per active local expert (on `packed`, pack_moe_weights' result, when given), the SwiGLU and the
    weighted combine fused."""
    return load().fused_moe(x.contiguous(), topk_weights.float().contiguous(), topk_ids.long().contiguous(),
                            w13, w2, expert_offset, packed)


def set_thread_cpus(cpus: list[int], one_each: bool) -> int:
    """The CPUs torch's op threads may run on (the calling thread is the first): thread i on
    cpus[i] alone when one_each, else each on all of cpus. How many threads set theirs (0 where
    the OS has no per-thread affinity)."""
    return load().set_thread_cpus(list(cpus), one_each)
