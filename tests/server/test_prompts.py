"""Prompts are measured before they are tokenized, and tokenized off the event loop."""

from __future__ import annotations

import asyncio
import time

import pytest

from server.errors import APIError
from server.prompts import PromptTokenizer, longest_token_bytes, prompt_items
from tests.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_prompt_items_counts_without_tokenizing():
    assert len(prompt_items("a")) == 1 and len(prompt_items([1, 2, 3])) == 1
    assert len(prompt_items(["a", "b"])) == 2 and len(prompt_items([[1], [2], [3]])) == 3
    assert len(prompt_items([])) == 1  # one empty prompt: refused by name later


def test_the_byte_bound_never_refuses_a_prompt_that_fits(tokenizer):
    """The bound is a true upper bound: the longest text of max_model_len tokens is inside it."""
    longest = max(tokenizer.get_vocab(), key=lambda t: len(tokenizer.convert_tokens_to_string([t]).encode()))
    text = tokenizer.convert_tokens_to_string([longest]) * 50
    assert len(text.encode()) <= 50 * longest_token_bytes(tokenizer)
    prompts = PromptTokenizer(tokenizer, max_model_len=len(tokenizer(text).input_ids) + 1)
    (p,) = asyncio.run(prompts.completion_prompts(text))
    assert p.token_ids == tokenizer(text).input_ids


def test_an_oversized_prompt_is_refused_without_tokenizing(tokenizer):
    prompts = PromptTokenizer(tokenizer, max_model_len=1024)
    prompts._encode_all = None  # tokenizing it would now raise a TypeError, not the 400 below
    for call in (prompts.completion_prompts("x" * (8 << 20)),
                 prompts.chat_prompt([{"role": "user", "content": "x" * (8 << 20)}])):
        with pytest.raises(APIError) as e:
            asyncio.run(call)
        assert e.value.status == 400 and e.value.code == "context_length_exceeded"


def test_tokenizing_does_not_block_the_event_loop(tokenizer):
    """While a long prompt is tokenized the loop keeps ticking (/health stays responsive)."""
    prompts = PromptTokenizer(tokenizer, max_model_len=1 << 20)
    text = "The quick brown fox jumps over the lazy dog. " * 20_000  # ~900 KB

    async def main():
        gaps, stop = [], False

        async def ticker():
            last = time.perf_counter()
            while not stop:
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.ensure_future(ticker())
        start = time.perf_counter()
        await prompts.completion_prompts(text)
        took = time.perf_counter() - start
        stop = True
        await tick
        return took, gaps

    took, gaps = asyncio.run(main())
    assert len(gaps) >= 3, took  # the loop ran while the worker thread tokenized
    assert max(gaps) < max(0.5 * took, 0.05), (took, max(gaps))
