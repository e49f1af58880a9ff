"""Sampling: seeds reproduce, greedy equivalences, penalty formulas on hand-made logits, the
sampled distribution, and logprobs against transformers' own logits."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine import SamplingParams
from engine.request import Request
from engine.sampler import Sampler, apply_penalties, filter_logits
from tests.engine.hf_oracle import hf_greedy, hf_logits

PROMPTS = [[5, 17, 42, 99], [7] * 20, [300, 200, 100]]


def _tokens(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def test_fixed_seed_reproduces_and_ignores_batch_company(tiny_llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, seed=1234, ignore_eos=True)
    a = _tokens(tiny_llm.generate(PROMPTS, p, use_tqdm=False))
    b = _tokens(tiny_llm.generate(PROMPTS, p, use_tqdm=False))
    assert a == b
    alone = _tokens(tiny_llm.generate(PROMPTS[1:2], p, use_tqdm=False))
    assert alone == a[1:2], "a seeded request samples the same whatever else is in the batch"
    other = _tokens(tiny_llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=12, seed=99,
                                                               ignore_eos=True), use_tqdm=False))
    assert other != a


def test_top_k_1_and_temperature_0_equal_greedy(tiny_llm, tiny_models):
    path = tiny_models("llama")
    expected = [hf_greedy(path, p, 10) for p in PROMPTS]
    t0 = _tokens(tiny_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False))
    k1 = _tokens(tiny_llm.generate(PROMPTS, SamplingParams(temperature=1.3, top_k=1, max_tokens=10, seed=5,
                                                            ignore_eos=True), use_tqdm=False))
    assert t0 == expected and k1 == expected


def test_penalties_follow_their_formulas():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -0.2])
    prompt, output = [0, 4], [1, 1, 2]
    got = apply_penalties(logits.clone(), prompt, output, presence=0.5, frequency=0.25, repetition=2.0)
    # Repetition (seen anywhere): positive / 2, negative * 2. Then OpenAI's on output counts.
    expected = [2.0 / 2, -1.0 * 2 - (0.25 * 2 + 0.5), 0.5 / 2 - (0.25 * 1 + 0.5), 3.0, -0.2 * 2]
    assert got.tolist() == pytest.approx(expected)
    unchanged = apply_penalties(logits.clone(), prompt, output, presence=0.0, frequency=0.0, repetition=1.0)
    assert torch.equal(unchanged, logits)


def test_filters_keep_the_documented_sets():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    kept = lambda x: (~torch.isinf(x)).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2, top_p=1.0, min_p=0.0)) == [0, 1]
    assert kept(filter_logits(logits, top_k=0, top_p=0.8, min_p=0.0)) == [0, 1, 2]  # 0.5+0.2 < 0.8 <= +0.15
    assert kept(filter_logits(logits, top_k=0, top_p=0.7, min_p=0.0)) == [0, 1]
    assert kept(filter_logits(logits, top_k=0, top_p=1.0, min_p=0.3)) == [0, 1, 2]  # p >= 0.3 * 0.5


def test_sampled_frequencies_match_softmax():
    probs = torch.tensor([0.05, 0.6, 0.25, 0.1])
    logits = torch.log(probs) * 0.5  # temperature 0.5 undoes the 0.5 scale
    sampler = Sampler([], seed=0, device=torch.device("cpu"))
    req = Request("r", [1], SamplingParams(temperature=0.5, seed=7))
    n = 4000
    counts = torch.zeros(4)
    for _ in range(n):
        counts[sampler(logits[None], [req])[0].token_id] += 1
    # Each frequency within 5 standard deviations of its binomial mean.
    for p, c in zip(probs.tolist(), counts.tolist()):
        assert abs(c - n * p) < 5 * math.sqrt(n * p * (1 - p)), (counts, probs)


def test_min_tokens_masks_eos_and_stop_ids():
    sampler = Sampler([3], seed=0, device=torch.device("cpu"))
    logits = torch.tensor([[0.0, 0.0, 1.0, 9.0, 8.0]])
    req = Request("r", [1], SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4]))
    assert sampler(logits, [req])[0].token_id == 2
    req.output_token_ids = [2, 2]
    assert sampler(logits, [req])[0].token_id == 3


def test_logprobs_equal_transformers_log_softmax(tiny_llm, tiny_models):
    path = tiny_models("llama")
    prompt = PROMPTS[0]
    out = tiny_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2,
                                                     ignore_eos=True), use_tqdm=False)[0]
    choice = out.outputs[0]
    ref = torch.log_softmax(hf_logits(path, prompt + choice.token_ids), dim=-1)
    total = 0.0
    for i, (tok, entry) in enumerate(zip(choice.token_ids, choice.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert entry[tok] == pytest.approx(float(row[tok]), abs=1e-4)
        assert set(entry) >= set(torch.topk(row, 3).indices.tolist())
        total += entry[tok]
    assert choice.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert out.prompt_logprobs[0] is None
    for j, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry[prompt[j]] == pytest.approx(float(ref[j - 1, prompt[j]]), abs=1e-4)
