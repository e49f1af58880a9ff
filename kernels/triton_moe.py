"""Triton fused mixture of experts: a grouped GEMM over expert-sorted token blocks (vLLM's fused_moe).

The T * top_k (token, expert) slots are sorted by local expert and each expert's list padded to a
multiple of BLOCK_M (expert_blocks, torch ops), so every block of BLOCK_M sorted slots belongs to one
expert. One launch multiplies each block's token rows by its expert's w13 (gate and up together),
the fused SiLU-and-mul kernel follows, a second launch multiplies by the expert's w2 and the routing
weight, and the top_k partial rows of each token are summed. Every size comes from shapes and no
value is read back from the GPU, so a decode step that calls it can be captured in a CUDA graph.

Imported only once the triton backend is chosen (kernels/__init__.py), like kernels/triton_ops.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import triton_ops


@triton.jit(do_not_specialize=["num_slots"])  # tokens x top_k: a new batch size must not recompile
def grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_slots_ptr, block_experts_ptr,
                        N, K, num_slots, stride_a_row, stride_b_expert, stride_b_row, stride_c_row,
                        SLOTS_PER_A_ROW: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """c[slot, n] = a[slot // SLOTS_PER_A_ROW] . b[expert, n] (times the slot's routing weight) for
    the BLOCK_M sorted slots of one block and BLOCK_N columns; a, b rows and c rows contiguous."""
    expert = tl.load(block_experts_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return  # past the last expert's blocks: the grid is sized for the worst case
    slots = tl.load(sorted_slots_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    real = slots < num_slots  # the rest pad the expert's list to whole blocks
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (slots // SLOTS_PER_A_ROW).to(tl.int64)[:, None] * stride_a_row + ks[None, :]
    b_ptrs = b_ptr + expert * stride_b_expert + cols.to(tl.int64)[None, :] * stride_b_row + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_in = ks < K - k0
        a = tl.load(a_ptrs, mask=real[:, None] & k_in[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_in[:, None] & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + slots, mask=real, other=0.0)[:, None]
    c_ptrs = c_ptr + slots.to(tl.int64)[:, None] * stride_c_row + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=real[:, None] & (cols[None, :] < N))


@dataclass(frozen=True)
class MoeTiles:
    block_m: int  # sorted slots per block: one expert's rows
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def moe_tiles(num_slots: int, num_experts: int) -> MoeTiles:
    """vLLM's untuned defaults: few slots per expert (decode) is a weight-streaming GEMV, small row
    blocks and long K steps; many (prefill) a real GEMM with 64-row blocks. tl.dot needs M >= 16."""
    if num_slots <= 16 * num_experts:
        return MoeTiles(16, 64, 64, 4, 3)
    return MoeTiles(64, 64, 32, 4, 3)


def expert_blocks(topk_ids: torch.Tensor, num_experts: int, expert_offset: int,
                  block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_align_block_size: (sorted_slots [num_blocks * block_m] int32, block_experts [num_blocks]
    int32). Slot s = token * top_k + j; each held expert's slots in slot order, padded with
    num_slots to a multiple of block_m; block b holds local expert block_experts[b], or -1 past the
    last expert's blocks. Slots of experts held on other ranks appear nowhere."""
    num_slots, dev = topk_ids.numel(), topk_ids.device
    local = topk_ids.flatten().long() - expert_offset
    expert = torch.where((local >= 0) & (local < num_experts), local, num_experts)  # elsewhere: one group, last
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, expert, torch.ones_like(expert))
    order = torch.argsort(expert, stable=True)
    group_start = counts.cumsum(0) - counts
    padded = (counts + block_m - 1) // block_m * block_m  # the last group's entry is never read
    padded_end = padded.cumsum(0)
    # Each expert adds at most one part-filled block to the whole blocks of all its slots.
    num_blocks = num_slots // block_m + min(num_experts, num_slots)
    dump = num_blocks * block_m  # one extra entry takes the slots held elsewhere, then is cut off
    sorted_expert = expert[order]
    rank = torch.arange(num_slots, device=dev) - group_start[sorted_expert]
    dest = torch.where(sorted_expert < num_experts, padded_end[sorted_expert] - padded[sorted_expert] + rank, dump)
    sorted_slots = torch.full((dump + 1,), num_slots, dtype=torch.int32, device=dev)
    sorted_slots.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(num_blocks, device=dev) * block_m
    block_experts = torch.searchsorted(padded_end[:num_experts], block_start, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return sorted_slots[:dump], block_experts


def _grouped_gemm(a, b, c, topk_weights, sorted_slots, block_experts, slots_per_a_row: int, mul_routed_weight: bool,
                  tiles: MoeTiles) -> None:
    n, k = b.shape[1], b.shape[2]
    grid = (block_experts.numel(), triton.cdiv(n, tiles.block_n))
    grouped_gemm_kernel[grid](
        a, b, c, topk_weights, sorted_slots, block_experts, n, k, c.shape[0],
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        SLOTS_PER_A_ROW=slots_per_a_row, MUL_ROUTED_WEIGHT=mul_routed_weight,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        # float32 is for tests: keep it exact instead of TF32 on tensor cores.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def fused_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, expert_offset: int = 0, packed=None) -> torch.Tensor:
    """kernels.reference.fused_moe as two grouped GEMMs. `packed` is unused: the kernels read the
    stacked weights as they are."""
    num_tokens, hidden = x.shape
    num_experts, two_ffn, _ = w13.shape
    top_k = topk_ids.shape[1]
    assert w13.shape[2] == hidden and w2.shape == (num_experts, hidden, two_ffn // 2), "w13/w2 do not fit x"
    assert x.stride(1) == w13.stride(2) == w2.stride(2) == 1, "rows of x, w13 and w2 must be contiguous"
    assert topk_ids.shape == topk_weights.shape == (num_tokens, top_k)
    triton_ops._check_device(x)
    if num_tokens == 0:
        return x.new_empty(0, hidden)
    num_slots = num_tokens * top_k
    tiles = moe_tiles(num_slots, num_experts)
    sorted_slots, block_experts = expert_blocks(topk_ids, num_experts, expert_offset, tiles.block_m)
    weights = topk_weights.float().contiguous()
    gate_up = torch.empty(num_slots, two_ffn, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, weights, sorted_slots, block_experts, top_k, False, tiles)
    act = triton_ops.silu_and_mul(gate_up)  # rows of slots routed elsewhere hold garbage no one reads
    # float32 partial rows, summed over top_k and rounded once: the reference's float32 accumulator.
    # Zeros, since the rows of slots routed to other ranks' experts are never written.
    partial = torch.zeros(num_slots, hidden, dtype=torch.float32, device=x.device)
    _grouped_gemm(act, w2, partial, weights, sorted_slots, block_experts, 1, True, tiles)
    return partial.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
