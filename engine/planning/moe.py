"""Mixture-of-experts configs: which MoE variants the planner models, and the fields it reads from them.

Modelled, as Hugging Face transformers builds them (one SwiGLU expert = gate, up and down projections):
  mixtral    every layer is MoE: `num_local_experts` experts of `intermediate_size`, top `num_experts_per_tok`,
             a router `gate` [experts, hidden] (Jiang et al. 2024, "Mixtral of Experts", §2.1)
  qwen2_moe  `num_experts` experts of `moe_intermediate_size`, plus one shared expert of
             `shared_expert_intermediate_size` behind a sigmoid `shared_expert_gate` [1, hidden]; q/k/v biases
  qwen3_moe  `num_experts` experts of `moe_intermediate_size`, no shared expert; q/k RMSNorm
  gpt_oss    as mixtral (every layer, `num_local_experts` of `intermediate_size`); its expert and router
             biases (hidden + 2 x intermediate a expert) are left out, a few parts per million of its weights
Qwen's layer i is MoE iff i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0; its other
layers are dense MLPs of `intermediate_size` (transformers' Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer).

Not modelled, refused with the field that shows it: DeepSeek-V2/V3 (multi-head latent attention
`kv_lora_rank`, grouped routing `n_group` / `topk_group`, `n_routed_experts`), and any other model type
that declares experts (its tensors are not the ones counted here).
"""

from __future__ import annotations

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")
# Keys that declare experts (or DeepSeek's MoE machinery) in some Hugging Face config.
MOE_MARKERS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size",
               "num_experts_per_tok")
# Keys of variants whose parameters or routing differ from the three above.
NOT_MODELLED = {
    "kv_lora_rank": "multi-head latent attention (DeepSeek-V2/V3)",
    "q_lora_rank": "multi-head latent attention (DeepSeek-V2/V3)",
    "n_group": "grouped expert routing (DeepSeek-V3)",
    "topk_group": "grouped expert routing (DeepSeek-V3)",
    "n_routed_experts": "DeepSeek's routed plus shared experts",
}


def declares_experts(cfg: dict) -> bool:
    return any(cfg.get(key) for key in MOE_MARKERS) or any(cfg.get(key) is not None for key in NOT_MODELLED)


def moe_fields(cfg: dict, model_type: str) -> dict:
    """ModelSpec fields of an MoE config (num_experts, experts_per_token, expert_ffn_size,
    shared_expert_ffn_size, moe_layers); ValueError naming the field of a variant not modelled."""
    for key, what in NOT_MODELLED.items():
        if cfg.get(key) is not None:
            raise ValueError(f"config field {key!r} ({what}, model_type {model_type!r}) is not modelled: "
                             f"mixture-of-experts models understood are {', '.join(MOE_MODEL_TYPES)}")
    if model_type not in MOE_MODEL_TYPES:
        field = next(key for key in MOE_MARKERS if cfg.get(key))
        raise ValueError(f"config field {field!r}: mixture-of-experts model_type {model_type!r} is not modelled; "
                         f"understood are {', '.join(MOE_MODEL_TYPES)}")
    layers = cfg["num_hidden_layers"]
    # Hub configs write Mixtral's count as num_local_experts, Qwen's as num_experts; transformers 5 writes
    # Qwen3-MoE's to_dict() with num_local_experts too.
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if model_type in ("mixtral", "gpt_oss"):
        expert_ffn, shared, moe_layers = cfg["intermediate_size"], 0, range(layers)
    else:
        expert_ffn = cfg["moe_intermediate_size"]
        shared = (cfg.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
        dense, step = set(cfg.get("mlp_only_layers") or ()), cfg.get("decoder_sparse_step") or 1
        moe_layers = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    top_k = cfg["num_experts_per_tok"]
    if not isinstance(experts, int) or experts <= 0:
        raise ValueError(f"config field 'num_experts': must be a positive integer, got {experts!r}")
    if not isinstance(top_k, int) or not 0 < top_k <= experts:
        raise ValueError(f"config field 'num_experts_per_tok': {top_k!r} experts per token, but the model has "
                         f"{experts} experts")
    return dict(num_experts=experts, experts_per_token=top_k, expert_ffn_size=expert_ffn,
                shared_expert_ffn_size=shared, moe_layers=tuple(moe_layers))
