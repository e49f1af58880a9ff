"""Engine test fixtures: tiny random models of each family, built once per test run."""

from __future__ import annotations

import pytest

from tests.tiny_model import build_tiny_model

# (model_type, overrides): several head dims, GQA ratios, tied and untied embeddings.
FAMILIES = {
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "llama-mha-tied": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", num_attention_heads=8, num_key_value_heads=2, head_dim=8),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    # Mixture of experts: 8 experts, top-2, expert sizes no other family has; Qwen2-MoE with its
    # gated shared expert and a dense layer on each side of its sparse one, Qwen3-MoE with q/k norms,
    # renormalised top-k and a dense first layer (mlp_only_layers).
    "mixtral": dict(model_type="mixtral", num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                    num_experts_per_tok=2, intermediate_size=36),
    "qwen2_moe": dict(model_type="qwen2_moe", num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=20, intermediate_size=52,
                      shared_expert_intermediate_size=44, decoder_sparse_step=2, norm_topk_prob=False),
    "qwen3_moe": dict(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=20,
                      intermediate_size=52, mlp_only_layers=[0], norm_topk_prob=True),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    cache = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = build_tiny_model(tmp_path_factory.mktemp(name), **FAMILIES[name])
        return cache[name]

    return get


@pytest.fixture(scope="session")
def tiny_llm(tiny_models):
    """One shared engine on the tiny Llama, roomy enough that nothing is preempted."""
    from engine import LLM

    return LLM(tiny_models("llama"), device="cpu", num_kv_blocks=256, max_model_len=512, seed=0)
