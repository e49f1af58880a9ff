"""PEFT as the independent oracle for LoRA: adapters written by PEFT itself for a tiny base model,
and transformers + PEFT generating greedily with one adapter at a time."""

from __future__ import annotations

import functools
import os

import torch


def build_adapter(base: str, path: str | os.PathLike, rank: int, targets: list[str], alpha: float | None = None,
                  use_rslora: bool = False, seed: int = 0, **config) -> str:
    """A random LoRA adapter for the model at `base`, saved by PEFT (adapter_config.json +
    adapter_model.safetensors). B is random too (PEFT's init_lora_weights=False), so the adapter
    changes the model's outputs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=targets,
                      init_lora_weights=False, use_rslora=use_rslora, lora_dropout=0.0, **config)
    peft_model = get_peft_model(model, lora)
    peft_model.save_pretrained(str(path))
    return str(path)


@functools.lru_cache(maxsize=8)
def peft_model(base: str, adapter: str | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    return model if adapter is None else PeftModel.from_pretrained(model, adapter).eval()


def peft_greedy(base: str, adapter: str | None, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers + PEFT's greedy continuation of `prompt` (EOS an ordinary token, as hf_greedy)."""
    import copy

    model = peft_model(base, adapter)
    inner = model if adapter is None else model.get_base_model()
    saved = copy.deepcopy(inner.generation_config)
    config = inner.generation_config
    config.do_sample, config.max_new_tokens, config.pad_token_id, config.eos_token_id = False, max_new_tokens, 0, None
    ids = torch.tensor([prompt])
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    finally:
        inner.generation_config = saved
    return out[0, len(prompt):].tolist()
