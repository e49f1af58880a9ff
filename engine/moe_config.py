"""What the engine needs to know of a mixture-of-experts config.json, read once.

The fields themselves (Mixtral's `num_local_experts` and `intermediate_size` are Qwen's
`num_experts` and `moe_intermediate_size`; Qwen2-MoE's shared expert; Qwen's dense layers
between sparse ones) are read by engine/planning/moe.py, the one place that knows them, so the
planner and the engine count the same experts. This adds what only running the model needs (how
routing weights are normalised, how ranks may split the experts). The models build from it
(engine/models/moe.py), and the layout checks size their shards from it (engine/distributed/layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.planning.moe import MOE_MODEL_TYPES, moe_fields


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int  # experts per token
    expert_ffn: int  # each expert's intermediate size
    renormalize: bool  # top-k weights rescaled to sum to 1 (Mixtral always; Qwen: norm_topk_prob)
    shared_expert_ffn: int  # 0: none (Qwen2-MoE's gated shared expert otherwise)
    sparse_layers: tuple[int, ...]  # the layers whose MLP is routed; the others are dense

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    @classmethod
    def from_hf_config(cls, cfg) -> MoeConfig | None:
        """None for a dense model; a ValueError naming the config field for one that cannot be run."""
        if cfg.model_type not in MOE_MODEL_TYPES:
            return None
        f = moe_fields(cfg.to_dict(), cfg.model_type)
        return cls(num_experts=f["num_experts"], top_k=f["experts_per_token"], expert_ffn=f["expert_ffn_size"],
                   renormalize=cfg.model_type == "mixtral" or bool(getattr(cfg, "norm_topk_prob", False)),
                   shared_expert_ffn=f["shared_expert_ffn_size"], sparse_layers=tuple(f["moe_layers"]))

    def shard_problem(self, tp: int, expert_parallel: bool) -> str | None:
        """Why `tp` ranks cannot split the experts (whole experts under expert parallelism, each
        expert's intermediate size otherwise), or None."""
        if expert_parallel and self.num_experts % tp:
            return (f"expert parallel over tensor_parallel_size {tp} ranks needs the number of experts "
                    f"({self.num_experts}) to be a multiple of it")
        if not expert_parallel and self.expert_ffn % tp:
            return (f"tensor_parallel_size {tp} does not divide the experts' intermediate size {self.expert_ffn}; "
                    "use a divisor, or --enable-expert-parallel to split whole experts instead")
        if self.shared_expert_ffn % tp:
            return f"tensor_parallel_size {tp} does not divide shared_expert_intermediate_size {self.shared_expert_ffn}"
        return None
