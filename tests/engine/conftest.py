"""Engine test fixtures: tiny random models of each family, built once per session."""

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
}


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

    return LLM(tiny_models("llama"), num_kv_blocks=256, max_model_len=512, seed=0)
