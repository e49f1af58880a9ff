"""model_type (from config.json) -> model class."""

from __future__ import annotations

from engine.models.gemma import GemmaForCausalLM
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.moe import MoeForCausalLM
from engine.models.phi3 import Phi3ForCausalLM

MODEL_REGISTRY = {
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "phi3": Phi3ForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "mixtral": MoeForCausalLM,
    "qwen2_moe": MoeForCausalLM,
    "qwen3_moe": MoeForCausalLM,
}

# A multimodal model_type whose language model is served, text only: its config's text_config is the
# model's config (its checkpoint's language-model tensors load, the vision tower's are skipped).
TEXT_CONFIG_TYPES = {"gemma3": "gemma3_text"}


def model_class(model_type: str):
    try:
        return MODEL_REGISTRY[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported model types: {sorted(MODEL_REGISTRY)}"
        ) from None
