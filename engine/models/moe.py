"""The mixture-of-experts members of the Llama family: Mixtral, Qwen2-MoE and Qwen3-MoE.

Attention, norms, embeddings and the pipeline plumbing are llama.py's (Qwen2-MoE has Qwen2's qkv
bias, Qwen3-MoE Qwen3's q/k norms); a sparse layer's MLP is a router choosing each token's top-k
experts (engine/layers/moe.py), plus, in Qwen2-MoE, a shared expert every token goes through,
scaled by its own sigmoid gate. Qwen's dense layers (mlp_only_layers, decoder_sparse_step) keep a
plain MLP.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.distributed.state import tp_all_reduce
from engine.layers.moe import EXPERT_PARTS, FusedMoE, Router
from engine.models.llama import MLP, LlamaForCausalLM
from engine.moe_config import MoeConfig

# model.layers.{i}.(mlp|block_sparse_moe).experts[.{e}].{part}[.weight]: one expert's matrix, or
# (no expert id) every expert's, stacked.
_EXPERT_RE = re.compile(r"(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?:(\d+)\.)?(\w+?)(?:\.weight)?")


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg, moe: MoeConfig):
        super().__init__()
        self.gate = Router(cfg.hidden_size, moe.num_experts)
        self.experts = FusedMoE(moe.num_experts, moe.top_k, cfg.hidden_size, moe.expert_ffn, moe.renormalize)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_ffn:
            self.shared_expert = MLP(cfg, moe.shared_expert_ffn, reduce_results=False)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            # Both are this rank's partial sums (the gate scales each rank's share alike): one reduction.
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return tp_all_reduce(y)


class MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg, max_positions: int, layer_range: tuple[int, int] | None = None):
        self.moe = MoeConfig.from_hf_config(cfg)  # read (and checked) once; make_mlp runs per layer
        super().__init__(cfg, max_positions, layer_range)

    def make_mlp(self, cfg, layer: int) -> nn.Module:
        return SparseMoeBlock(cfg, self.moe) if self.moe.is_sparse(layer) else MLP(cfg)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """Each expert's matrices (Mixtral's `block_sparse_moe.experts.{e}.w1/w2/w3`, Qwen's
        `mlp.experts.{e}.gate_proj/up_proj/down_proj`, or all experts stacked) go into the layer's
        w13 / w2 with (expert id or None, part) as the shard; Mixtral's router is `mlp.gate` here."""
        m = _EXPERT_RE.fullmatch(name)
        if m and m.group(3) in EXPERT_PARTS:
            layer, expert, part = m.groups()
            param = "w2" if EXPERT_PARTS[part] == "down" else "w13"
            return f"{layer}.mlp.experts.{param}", (None if expert is None else int(expert), EXPERT_PARTS[part])
        return super().checkpoint_target(name.replace(".block_sparse_moe.gate.", ".mlp.gate."))
