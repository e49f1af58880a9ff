"""model_type (from config.json) -> model class."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM

MODEL_REGISTRY = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def model_class(model_type: str):
    try:
        return MODEL_REGISTRY[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported model types: {sorted(MODEL_REGISTRY)}"
        ) from None
