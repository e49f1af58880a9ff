"""Greedy parity with transformers, token for token, under chunked prefill and preemption."""

from __future__ import annotations

import random
import zlib

import pytest

from engine import LLM, SamplingParams
from tests.engine.conftest import FAMILIES
from tests.engine.hf_oracle import hf_greedy

PROMPT_LENS = [1, 2, 7, 16, 17, 31, 64, 100, 128, 150, 220, 300]
MAX_TOKENS = 10


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids from 3 upward: 0-2 are the tokenizer's special tokens.
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


# CPU's default backend (C++ kernels, packed matmuls) for every family; the pure-torch reference
# backend, the CPU fallback, for three (Llama GQA, Qwen3 with q/k norms, Qwen2-MoE).
CASES = ([(family, "cpu") for family in sorted(FAMILIES)]
         + [("llama", "torch"), ("qwen3", "torch"), ("qwen2_moe", "torch")])


@pytest.mark.parametrize("family, backend", CASES)
def test_greedy_matches_transformers_with_chunking_and_preemption(family, backend, tiny_models):
    path = tiny_models(family)
    # 30 blocks of 16 = 480 tokens for 12 prompts of up to 310 tokens: they cannot all fit,
    # so the scheduler must preempt; a 64-token budget splits every longer prompt into chunks.
    llm = LLM(path, device="cpu", num_kv_blocks=30, block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
              max_model_len=480, seed=0, attention_backend=backend)
    assert llm.engine.runner.attn_backend == backend
    prompts = _prompts(llm.engine.vocab_size, seed=zlib.crc32(family.encode()))
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0, "the test must exercise preemption"
    assert stats["num_chunked_prefills"] > 0, "the test must exercise chunked prefill"
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"
    assert stats["num_used_blocks"] == 0, "every block is free or cached-and-unreferenced after the run"


def test_eos_stops_generation_like_transformers(tiny_models):
    """Without ignore_eos, generation ends at EOS exactly where transformers ends."""
    path = tiny_models("llama")
    llm = LLM(path, device="cpu", num_kv_blocks=128, max_model_len=512)
    eos = llm.engine.eos_token_ids
    assert eos, "the tiny tokenizer defines an EOS token"
    # Find prompts whose greedy continuation hits EOS within 40 tokens.
    rng = random.Random(3)
    prompts = [[rng.randrange(3, llm.engine.vocab_size) for _ in range(rng.randrange(1, 30))] for _ in range(40)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)
    stopped = 0
    for prompt, out in zip(prompts, outs):
        ref = hf_greedy(path, prompt, 40, ignore_eos=False)
        assert out.outputs[0].token_ids == ref
        if out.outputs[0].finish_reason == "stop":
            stopped += 1
            assert ref[-1] in eos
    assert stopped > 0, "no prompt reached EOS: the test proves nothing"
