"""LLM.chat's template options in vLLM's names (continue_final_message, chat_template_kwargs), with
transformers' own rendering of the same conversation as the oracle."""

from __future__ import annotations

import pytest

from engine import SamplingParams

ASK = [{"role": "user", "content": "What is the capital of France?"}]


def _ids(tok, messages, **options) -> list[int]:
    return tok(tok.apply_chat_template(messages, tokenize=False, **options), add_special_tokens=False).input_ids


def test_a_continued_reply_is_the_greedy_continuation_of_its_open_prompt(tiny_llm):
    tok = tiny_llm.tokenizer
    prefilled = ASK + [{"role": "assistant", "content": "The capital"}]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    out = tiny_llm.chat(prefilled, params, use_tqdm=False, add_generation_prompt=False,
                        continue_final_message=True)[0]
    ids = _ids(tok, prefilled, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt_token_ids == ids and tok.decode(ids).endswith("The capital")
    assert out.outputs[0].token_ids == tiny_llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids


def test_template_variables_reach_the_template(tiny_llm):
    params = SamplingParams(max_tokens=1, temperature=0.0)
    out = tiny_llm.chat(ASK, params, use_tqdm=False, chat_template_kwargs={"enable_thinking": False})[0]
    want = _ids(tiny_llm.tokenizer, ASK, add_generation_prompt=True, enable_thinking=False)
    assert out.prompt_token_ids == want
    assert len(want) > len(tiny_llm.chat(ASK, params, use_tqdm=False)[0].prompt_token_ids)  # the empty thought


def test_continuing_while_opening_a_reply_is_refused(tiny_llm):
    with pytest.raises(ValueError, match="^continue_final_message"):
        tiny_llm.chat(ASK, SamplingParams(max_tokens=1), use_tqdm=False, continue_final_message=True)


def test_template_variables_the_call_sets_itself_are_refused(tiny_llm):
    """chat_template_kwargs may not override what LLM.chat passes the template (tokenize=True would
    turn the prompt text into token ids): the same rule as the server's."""
    with pytest.raises(ValueError, match="^chat_template_kwargs: 'tokenize'"):
        tiny_llm.chat(ASK, SamplingParams(max_tokens=1), use_tqdm=False, chat_template_kwargs={"tokenize": True})
