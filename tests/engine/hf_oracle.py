"""transformers as the independent oracle: greedy generation and raw logits, one prompt at a time."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(path: str, prompt: list[int], max_new_tokens: int, ignore_eos: bool = True) -> list[int]:
    import copy

    model = hf_model(path)
    ids = torch.tensor([prompt])
    saved = copy.deepcopy(model.generation_config)
    config = model.generation_config
    config.do_sample, config.max_new_tokens, config.pad_token_id = False, max_new_tokens, 0
    if ignore_eos:
        # EOS as an ordinary token (not masked, as min_new_tokens would do): the engine's ignore_eos.
        # Cleared on the model itself: generate() refills a None EOS from the model's own config.
        config.eos_token_id = None
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids))
    finally:
        model.generation_config = saved
    return out[0, len(prompt):].tolist()


def hf_logits(path: str, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, float32 [len, vocab]."""
    with torch.no_grad():
        return hf_model(path)(torch.tensor([token_ids])).logits[0].float()


def hf_hidden(path: str, token_ids: list[int]) -> torch.Tensor:
    """Final hidden states (after the model's last norm) at every position, float64 [len, hidden]."""
    with torch.no_grad():
        return hf_model(path).model(torch.tensor([token_ids])).last_hidden_state[0].double()


def assert_first_tokens_close(llm, model, prompts: list[list[int]]) -> None:
    """A 16-bit engine against transformers `model` in the same dtype, one greedy token per prompt.
    Each rounds differently (and random tiny routers have near ties, so one flipped expert choice
    moves the last logprob by up to ~1): the first tokens agree but for one, each chosen token is
    (near) transformers' best, the typical logprob gap is 16-bit noise and none is far off."""
    from engine import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=0, ignore_eos=True),
                        use_tqdm=False)
    agree, gaps = 0, []
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        token = out.outputs[0].token_ids[0]
        agree += token == int(ref.argmax())
        assert float(ref.max() - ref[token]) < 0.1  # the engine's choice is (near) transformers' best
        gaps.append(abs(out.outputs[0].logprobs[0][token] - float(ref[token])))
    assert agree >= len(prompts) - 1
    assert sorted(gaps)[len(gaps) // 2] < 0.05 and max(gaps) < 1.0, gaps
