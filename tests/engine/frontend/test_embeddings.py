"""Embedding requests (SamplingParams.pooling; LLM.embed; /v1/embeddings underneath) against
transformers' final hidden states: last-token and mean pooling, L2-normalised, through chunked
prefill, beside generating requests, and unaffected by the prefix cache."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.hf_oracle import hf_greedy, hf_hidden

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 50)), [3] * 17]


def _want(path: str, ids: list[int], pooling: str) -> torch.Tensor:
    h = hf_hidden(path, ids)
    v = h[-1] if pooling == "last" else h.mean(0)
    return v / v.norm()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_hidden_states(tiny_llm, tiny_models, pooling):
    path = tiny_models("llama")
    got = tiny_llm.embed(PROMPTS, pooling=pooling, use_tqdm=False)
    for ids, vector in zip(PROMPTS, got):
        torch.testing.assert_close(torch.tensor(vector, dtype=torch.float64), _want(path, ids, pooling),
                                   atol=2e-5, rtol=1e-4)
    assert tiny_llm.engine.stats()["num_used_blocks"] == 0


def test_mean_pooling_across_prefill_chunks_and_a_warm_prefix_cache(tiny_models):
    """A 30-token prompt in chunks of 8 sums its states over four steps; run twice, the second
    run would find the prompt's blocks cached: mean pooling computes every position anyway."""
    path = tiny_models("llama")
    with LLM(path, device="cpu", num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=8, seed=0) as llm:
        first = llm.embed([PROMPTS[1]], pooling="mean", use_tqdm=False)[0]
        again = llm.embed([PROMPTS[1]], pooling="mean", use_tqdm=False)[0]
        assert first == again
        torch.testing.assert_close(torch.tensor(first, dtype=torch.float64), _want(path, PROMPTS[1], "mean"),
                                   atol=2e-5, rtol=1e-4)


def test_embedding_beside_generation(tiny_llm, tiny_models):
    """In one batch: the generating request still matches transformers, and the embedding
    request generates nothing and ends with its vector."""
    path = tiny_models("llama")
    outs = tiny_llm.generate(PROMPTS[:2], [SamplingParams(pooling="last"),
                                           SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)],
                             use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [] and outs[0].outputs[0].finish_reason == "stop"
    torch.testing.assert_close(torch.tensor(outs[0].embedding, dtype=torch.float64), _want(path, PROMPTS[0], "last"),
                               atol=2e-5, rtol=1e-4)
    assert outs[1].embedding is None and outs[1].outputs[0].token_ids == hf_greedy(path, PROMPTS[1], 6)


def test_pooling_is_checked():
    with pytest.raises(ValueError, match="^pooling"):
        SamplingParams(pooling="max")
    with pytest.raises(ValueError, match="^n must be 1 for an embedding request"):
        SamplingParams(pooling="mean", n=2)
