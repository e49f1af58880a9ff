"""Serving memory: weights per GPU, KV cache bytes per token, the KV budget and its capacity in blocks.

The engine sizes its paged KV cache with `kv_bytes_per_token`, `kv_budget_bytes` and
`kv_capacity_tokens`, so `engine plan serve` and a running engine agree on the number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.planning.comm import moe_all_to_all_bytes
from engine.planning.spec import ModelSpec


def kv_bytes_per_token(spec: ModelSpec, kv_dtype_bytes: int, tp: int = 1, pp: int = 1) -> int:
    """KV cache bytes one token takes on one GPU: 2 (K and V) x layers x KV heads x head_dim x bytes.

    Layers are those of the busiest pipeline stage, ceil(L / pp). Each TP rank holds
    max(1, kv_heads // tp) KV heads: with tp > kv_heads the KV heads are replicated (as vLLM does),
    so memory stops shrinking with TP there.
    """
    layers = -(-spec.num_layers // pp)
    kv_heads = max(1, spec.num_kv_heads // tp)
    return 2 * layers * kv_heads * spec.head_dim * kv_dtype_bytes


def kv_budget_bytes(gpu_memory_bytes: int, gpu_memory_utilization: float, non_kv_peak_bytes: int) -> int:
    """Bytes left for the KV cache on a GPU: total x utilization - peak of everything else (>= 0).

    `non_kv_peak_bytes` is weights plus the activation peak of one forward pass; the engine profiles
    it, the planner estimates it with `forward_workspace_bytes`. Same rule as vLLM's
    `gpu_memory_utilization`.
    """
    return max(0, int(gpu_memory_bytes * gpu_memory_utilization) - non_kv_peak_bytes)


def kv_capacity_tokens(kv_budget_bytes: int, kv_bytes_per_token: int, block_size: int) -> int:
    """Tokens the budget holds in whole blocks of `block_size` tokens (a partial block is unusable)."""
    return (kv_budget_bytes // (kv_bytes_per_token * block_size)) * block_size


def expert_shards(tp: int, ep: int) -> int:
    """GPUs one MoE layer's experts are spread over when serving. Without EP each TP rank holds 1/tp of
    every expert; with EP (vLLM's --enable-expert-parallel, EP size = DP x TP) each of ep ranks holds
    experts / ep whole experts, while attention and dense MLPs stay split over TP."""
    return ep if ep > 1 else tp


def forward_workspace_bytes(spec: ModelSpec, act_bytes: int, max_batched_tokens: int, max_seqs: int,
                            tp: int = 1, ep: int = 1) -> int:
    """Estimated activation peak of one inference forward over `max_batched_tokens` tokens.

    Nothing is kept for backward, so the peak is the widest point of one layer: the residual stream
    and its normed copy (2h) plus the wider of q/k/v and the MLP's up-projections with their product
    (3f for SwiGLU: gate, up, silu(gate)*up; 2f for GELU: fc, gelu(fc)), per TP rank. Sampling adds
    float32 logits for one token per sequence. An estimate: on CUDA the engine profiles the real peak.
    """
    qkv = spec.q_size // tp + 2 * max(1, spec.num_kv_heads // tp) * spec.head_dim
    mlp = (3 if spec.mlp == "swiglu" else 2) * spec.ffn_hidden_size // tp
    if spec.is_moe:  # each token visits k experts: their gate+up outputs, products and outputs
        expert_ffn = spec.expert_ffn_size // (1 if ep > 1 else tp)
        moe = spec.experts_per_token * (3 * expert_ffn + spec.hidden_size) + 3 * spec.shared_expert_ffn_size // tp
        mlp = max(mlp, moe) if len(spec.moe_layers) < spec.num_layers else moe
    per_token = 2 * spec.hidden_size + max(qkv, mlp)
    logits = max_seqs * -(-spec.vocab_size // tp) * 4
    return max_batched_tokens * per_token * act_bytes + logits


@dataclass(frozen=True)
class ServePlan:
    params: int
    active_params: int  # per token (an MoE model's top-k experts, not the others)
    weights_per_gpu: int
    workspace_bytes: int
    kv_bytes_per_token: int
    kv_budget_bytes: int
    kv_capacity_tokens: int
    num_kv_blocks: int
    max_model_len: int
    max_seqs_at_max_len: int
    fits: bool  # the weights and workspace leave room for at least one sequence of max_model_len
    ep_all_to_all_bytes_per_token: float = 0.0  # sent per GPU per token of a forward, EP only


def plan_serving(
    spec: ModelSpec,
    *,
    dtype_bytes: int,
    kv_dtype_bytes: int,
    max_model_len: int,
    block_size: int = 16,
    tp: int = 1,
    pp: int = 1,
    gpu_memory_bytes: int | None = None,
    gpu_memory_utilization: float = 0.90,
    kv_cache_memory_bytes: int | None = None,
    max_batched_tokens: int = 2048,
    max_seqs: int = 256,
    ep: int = 1,
) -> ServePlan:
    """Memory of one serving replica per GPU. `kv_cache_memory_bytes` is a fixed KV budget (the
    engine's CPU setting) that replaces the one derived from the GPU's memory."""
    weights = spec.params_per_gpu(tp, pp, expert_shards(tp, ep)) * dtype_bytes
    workspace = forward_workspace_bytes(spec, dtype_bytes, max_batched_tokens, max_seqs, tp, ep)
    if kv_cache_memory_bytes is not None:
        budget = kv_cache_memory_bytes
    elif gpu_memory_bytes is not None:
        budget = kv_budget_bytes(gpu_memory_bytes, gpu_memory_utilization, weights + workspace)
    else:
        raise ValueError("give either gpu_memory_bytes or kv_cache_memory_bytes")
    per_token = kv_bytes_per_token(spec, kv_dtype_bytes, tp, pp)
    tokens = kv_capacity_tokens(budget, per_token, block_size)
    blocks_per_seq = -(-max_model_len // block_size)
    seqs = tokens // block_size // blocks_per_seq
    return ServePlan(
        params=spec.params, active_params=spec.active_params, weights_per_gpu=weights, workspace_bytes=workspace,
        kv_bytes_per_token=per_token,
        kv_budget_bytes=budget, kv_capacity_tokens=tokens, num_kv_blocks=tokens // block_size,
        max_model_len=max_model_len, max_seqs_at_max_len=seqs, fits=seqs >= 1,
        ep_all_to_all_bytes_per_token=moe_all_to_all_bytes(spec, 1, dtype_bytes, ep,
                                                           moe_layers=-(-len(spec.moe_layers) // pp)),
    )
