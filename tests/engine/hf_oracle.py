"""transformers as the independent oracle: greedy generation and raw logits, one prompt at a time."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt: list[int], max_new_tokens: int, ignore_eos: bool = True) -> list[int]:
    model = hf_model(path)
    ids = torch.tensor([prompt])
    extra = {"min_new_tokens": max_new_tokens} if ignore_eos else {}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=0, **extra)
    return out[0, len(prompt):].tolist()


def hf_logits(path: str, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, float32 [len, vocab]."""
    with torch.no_grad():
        return hf_model(path)(torch.tensor([token_ids])).logits[0].float()
