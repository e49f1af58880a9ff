"""Automatic prefix caching: shared prefixes hit the cache and change no token."""

from __future__ import annotations

import random

from engine import LLM, SamplingParams


def test_shared_prefix_hits_and_same_tokens(tiny_models):
    path = tiny_models("llama")
    rng = random.Random(0)
    prefix = [rng.randrange(3, 500) for _ in range(160)]
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 20))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = {}
    for caching in (True, False):
        llm = LLM(path, device="cpu", num_kv_blocks=200, max_model_len=512, enable_prefix_caching=caching)
        # First one request alone, so its prefix blocks are computed and hashed, then the rest.
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        rest = llm.generate(prompts[1:], params, use_tqdm=False)
        results[caching] = [o.outputs[0].token_ids for o in first + rest]
        stats = llm.engine.stats()
        if caching:
            assert stats["prefix_cache_hits"] >= 7 * 160 // 16 * 16, stats
            assert stats["prefix_cache_hit_rate"] > 0.5
            assert all(o.num_cached_tokens == 160 for o in rest)
        else:
            assert stats["prefix_cache_hits"] == 0
        assert stats["num_used_blocks"] == 0
    assert results[True] == results[False]
