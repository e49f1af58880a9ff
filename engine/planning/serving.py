"""Serving memory: weights per GPU (linear layers in a quantized format where one is given: weight_formats.py),
KV cache bytes per token, the KV budget and its capacity in blocks.

The engine sizes its paged KV cache with `kv_bytes_per_token`, `kv_budget_bytes` and
`kv_capacity_tokens`, so `engine plan serve` and a running engine agree on the number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.planning.comm import moe_all_to_all_bytes
from engine.planning.layout import PlanError
from engine.planning.spec import ModelSpec
from engine.planning.weight_formats import WeightFormat, weight_bytes_per_gpu

# How a serving replica spreads a mixture-of-experts layer's experts (`plan serve`):
#   "tp"      none: every TP rank holds 1/tp of every expert's hidden units (the engine's default)
#   "engine"  the engine's --enable-expert-parallel: the TP ranks hold whole experts, experts / tp each (EP size =
#             TP); every rank runs its own experts on all the step's tokens and the TP all-reduce that follows
#             the MLP sums their outputs, so no all-to-all (engine/layers/moe.py, engine/models/moe.py)
#   "vllm"    vLLM's (and SGLang's --ep-size): EP size = DP x TP, experts / ep on each GPU while attention runs
#             data-parallel; tokens go to their experts' GPUs and back by all-to-all. Not a layout this engine runs.
EP_LAYOUTS = ("tp", "engine", "vllm")


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
    """GPUs one MoE layer's experts are spread over when serving: ep GPUs holding experts / ep whole experts
    each (ep = tp for the engine's --enable-expert-parallel, DP x TP for vLLM's), or, without EP, the tp ranks
    holding 1/tp of every expert; attention and dense MLPs stay split over TP either way."""
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
    ep_all_to_all_bytes_per_token: float = 0.0  # sent per GPU per token of a forward, vLLM's EP only
    weight_format: str = ""  # the linear layers' format: the dtype's name, or a --quantization format
    quantize_lm_head: bool = False  # the LM head (and a tied embedding) in weight_format too
    expert_parallel: str = "tp"  # EP_LAYOUTS
    ep_size: int = 1  # GPUs the experts are spread over whole (1: none)
    lora_slot_bytes: int = 0  # of weights_per_gpu: the LoRA adapter slots (lora.adapter_slot_bytes)


def served_len(spec: ModelSpec, requested: int | None) -> tuple[int, bool]:
    """(the context window the engine serves, whether a sliding window cut it): `requested` (or the
    model's positions), refused past the positions and cut to the window, as engine/runner/model_runner.py
    does (its attention is always full)."""
    length = requested or spec.max_position_embeddings
    limit = spec.position_limit or spec.max_position_embeddings
    if length > limit:
        raise PlanError("max_model_len", f"{length} exceeds the model's longest context ({limit}: "
                                         "max_position_embeddings, times a yarn/dynamic/linear rope factor), "
                                         "which the engine refuses too")
    if spec.sliding_window and spec.sliding_window < length:
        return spec.sliding_window, True
    return length, False


def cpu_head_copy(spec: ModelSpec, dtype: str, head_in_blocks: bool) -> bool:
    """Whether the cpu backend holds a tied LM head twice (the embedding's matrix and oneDNN's packed
    copy of it): a float head (`head_in_blocks`: quantized, or a GGUF file's blocks, is not) in float32
    or bfloat16 (oneDNN packs no float16), unless the checkpoint's bfloat16 matrices are kept as stored,
    which holds them once (engine/loading/weights.py keeps_bf16: in a float32 model, or a bfloat16 one on a CPU
    without AMX)."""
    if not spec.tie_word_embeddings or head_in_blocks:
        return False
    stored_bf16 = spec.checkpoint_dtype in ("bfloat16", "bf16")
    if dtype == "float32":
        return not stored_bf16
    return dtype == "bfloat16" and (not stored_bf16 or _cpu_has_amx())


def _cpu_has_amx() -> bool:
    """This machine's CPU flags (Linux; elsewhere: none), without importing torch."""
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


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
    ep_layout: str = "engine",
    weight_format: WeightFormat | None = None,
    dtype_name: str = "",
    head_copy: bool = False,
    lora_slot_bytes: int = 0,
) -> ServePlan:
    """Memory of one serving replica per GPU. `kv_cache_memory_bytes` is a fixed KV budget (the
    engine's CPU setting) that replaces the one derived from the GPU's memory. `ep` > 1 spreads the experts
    whole over ep GPUs, as `ep_layout` ("engine": ep = tp; "vllm": ep = DP x TP) does; `weight_format` holds
    the linear layers in that format (weight_formats.py), None at `dtype_bytes`. `head_copy`: the cpu
    backend's oneDNN copy of a tied float LM head, held on top of the embedding matrix both read
    (engine/layers/linear.py pack_weights; cpu_head_copy says when), on the head's GPU. `lora_slot_bytes`:
    LoRA adapter slots held beside the weights, which the KV cache budget gives up."""
    if ep_layout not in EP_LAYOUTS[1:]:
        raise ValueError(f"ep_layout must be one of {EP_LAYOUTS[1:]}, got {ep_layout!r}")
    if ep_layout == "engine" and ep not in (1, tp):
        raise ValueError(f"the engine's expert parallelism spreads the experts over the {tp} TP ranks: ep must be "
                         f"1 or {tp}, got {ep}")
    layout = "tp" if ep == 1 else ep_layout
    weights = weight_bytes_per_gpu(spec, dtype_bytes, weight_format, tp, pp, expert_shards(tp, ep))
    if head_copy:
        weights += -(-spec.vocab_size // tp) * spec.hidden_size * dtype_bytes
    weights += lora_slot_bytes
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
        ep_all_to_all_bytes_per_token=(moe_all_to_all_bytes(spec, 1, dtype_bytes, ep,
                                                            moe_layers=-(-len(spec.moe_layers) // pp))
                                       if layout == "vllm" else 0.0),
        weight_format=weight_format.name if weight_format else dtype_name,
        quantize_lm_head=weight_format is not None and weight_format.lm_head, expert_parallel=layout, ep_size=ep,
        lora_slot_bytes=lora_slot_bytes,
    )
