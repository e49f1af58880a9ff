"""Speculative decoding for sampled requests: the tokens follow the distribution the sampler draws
from without speculation (a chi-square two-sample test, which a wrong acceptance rule fails); a
seeded request gives its tokens without speculation, whatever processing reads the earlier tokens;
and a stream whose drafts keep failing backs off, while one whose drafts are accepted does not."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from engine import LLM, SamplingParams
from engine.core import draft_backoff, ngram_proposer
from engine.core.draft_backoff import DraftBackoff
from engine.core.scheduler import speculates
from engine.runner import step_outputs
from engine.runner.runner_streams import CachedRequestState
from engine.runner.sampler import Sampler
from engine.sampling_params import GrammarSpec
from engine.scheduler_output import ModelRunnerOutput, NewRequestData

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
# The tiny Llama's greedy text after [100] * 16 is the cycle 425, 463; quoted in the prompt, prompt
# lookup drafts the cycle, which the sampled continuation follows often and leaves often.
CYCLE_PROMPT = [100] * 16 + [425, 463] * 4
NUM_SEQUENCES = 4000
NUM_TOKENS = 5


def _llm(path, spec, **config) -> LLM:
    return LLM(path, **{"device": "cpu", "dtype": "float32", "num_kv_blocks": 2048, "max_model_len": 128,
                        "max_num_seqs": 256, "max_num_batched_tokens": 4096, "speculative_config": spec, **config})


def _sample(path, spec, seeds, **params) -> tuple[list[tuple[int, ...]], dict]:
    llm = _llm(path, spec)
    try:
        outs = llm.generate([CYCLE_PROMPT] * len(seeds),
                            [SamplingParams(seed=s, max_tokens=NUM_TOKENS, ignore_eos=True, **params) for s in seeds],
                            use_tqdm=False)
        return [tuple(o.outputs[0].token_ids) for o in outs], llm.engine.stats()
    finally:
        llm.shutdown()


def _two_sample_p(a: list[int], b: list[int]) -> float:
    """Chi-square two-sample test of two token histograms (Pearson's, on the 2 x tokens table);
    tokens seen fewer than 20 times in both samples together share one cell."""
    ca, cb = collections.Counter(a), collections.Counter(b)
    common = [t for t in ca.keys() | cb.keys() if ca[t] + cb[t] >= 20]
    table = [[c[t] for t in common] + [sum(c.values()) - sum(c[t] for t in common)] for c in (ca, cb)]
    table = np.array(table)
    return float(chi2_contingency(table[:, table.sum(0) > 0], correction=False)[1])


def _p_value(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> float:
    """Bonferroni over the positions drafts are verified at (the first token is the prompt's)."""
    return min(1.0, (NUM_TOKENS - 1) * min(_two_sample_p([s[j] for s in a], [s[j] for s in b])
                                           for j in range(1, NUM_TOKENS)))


@pytest.mark.slow
def test_sampled_tokens_follow_the_distribution_of_plain_sampling_and_a_wrong_rule_fails(tiny_models,
                                                                                         monkeypatch):
    """4,000 sequences of 5 tokens (temperature 1, top_k 4) with speculation against 4,000 without,
    other seeds: the per-position histograms agree (p = 0.44, Bonferroni over positions 2-5). The
    same test rejects a wrong acceptance rule: every draft accepted (p underflows to 0), or the first
    draft always accepted and the rest by the rule (p = 5e-294)."""
    path = tiny_models("llama")
    params = dict(temperature=1.0, top_k=4)
    plain, _ = _sample(path, None, range(NUM_SEQUENCES, 2 * NUM_SEQUENCES), **params)
    spec, stats = _sample(path, SPEC, range(NUM_SEQUENCES), **params)
    assert stats["num_draft_tokens"] > stats["num_accepted_tokens"] > 1000  # drafts accepted and rejected
    p = _p_value(spec, plain)
    assert p > 0.01, f"speculative and plain sampling differ: p = {p:.3g}"

    exact = step_outputs.accepted_length
    wrong_rules = {"every draft accepted": lambda drafts, targets: len(drafts),
                   "the first draft always accepted": lambda drafts, targets: max(1, exact(drafts, targets))}
    for name, rule in wrong_rules.items():
        monkeypatch.setattr(step_outputs, "accepted_length", rule)
        broken, stats = _sample(path, SPEC, range(NUM_SEQUENCES), **params)
        assert stats["num_accepted_tokens"] > 0
        p = _p_value(broken, plain)
        assert p < 1e-6, f"{name} went unnoticed: p = {p:.3g}"


def _bad_word(path) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).decode([463])


# Each reads what the sampler reads of a row: the processing a verify row must apply as the plain
# sampler does at that position (penalties and bad_words over the drafts before it as output).
PROCESSING = [
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=1.0, top_k=6, min_p=0.1),
    dict(temperature=1.0, top_k=4, presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.1),
    dict(temperature=1.0, top_k=4, logit_bias={463: 1.5, 431: -2.0}),
    dict(temperature=1.0, allowed_token_ids=[425, 463, 431, 363, 212, 7]),
    dict(temperature=1.0, top_k=4, min_tokens=10, stop_token_ids=[425]),
    dict(temperature=0.0, presence_penalty=0.3, repetition_penalty=1.05),
    dict(temperature=1.0, top_k=4, n=2),
]


def test_a_seeded_request_gives_its_tokens_without_speculation(tiny_models):
    path = tiny_models("llama")
    params = [SamplingParams(seed=seed, max_tokens=24, ignore_eos=True, **p) for p in PROCESSING for seed in range(4)]
    params.append(SamplingParams(seed=1, max_tokens=24, ignore_eos=True, temperature=1.0, top_k=4,
                                 bad_words=[_bad_word(path)]))

    def run(spec):
        llm = _llm(path, spec, max_num_seqs=64)
        try:
            outs = llm.generate([CYCLE_PROMPT] * len(params), params, use_tqdm=False)
            return [[c.token_ids for c in o.outputs] for o in outs], llm.engine.stats()
        finally:
            llm.shutdown()

    with_spec, stats = run(SPEC)
    assert stats["num_draft_tokens"] > stats["num_accepted_tokens"] > 50  # every case accepts some
    assert stats["num_used_blocks"] == 0
    without, _ = run(None)
    for p, a, b in zip(params, with_spec, without):
        assert a == b, p
    assert all(463 not in c for c in with_spec[-1])  # the bad word held across the verified tokens


def test_back_off_pauses_grow_while_drafts_fail_and_an_accepted_one_ends_them():
    backoff = DraftBackoff()
    proposed = []
    for step in range(300):
        if backoff.proposes():
            proposed.append(step)
            backoff.record(0)
    gaps = np.diff(proposed).tolist()
    first, longest = draft_backoff.FIRST_PAUSE, draft_backoff.MAX_PAUSE
    assert gaps[:draft_backoff.MISSES - 1] == [1] * (draft_backoff.MISSES - 1)
    pauses = [g - 1 for g in gaps[draft_backoff.MISSES - 1:]]
    assert pauses[:3] == [first, 2 * first, 4 * first] and max(pauses) == longest == pauses[-1]
    backoff = DraftBackoff()
    for step in range(100):  # one draft in three accepts something: never a pause
        assert backoff.proposes()
        backoff.record(int(step % 3 == 2))


def test_drafts_that_never_match_become_rare_and_matching_ones_are_unaffected(tiny_models, monkeypatch):
    path = tiny_models("llama")
    prompt = [100] * 16
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, logit_bias={7: -100.0})
    plain = _llm(path, None)
    try:
        reference = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        plain.shutdown()

    def run(propose):
        monkeypatch.setattr(ngram_proposer, "propose", propose)
        llm = _llm(path, SPEC)
        try:
            out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            return out, llm.engine.stats()
        finally:
            llm.shutdown()

    # Token 7, which the request's logit_bias rules out: every draft is rejected.
    out, stats = run(lambda tokens, k, *_: [7] * k)
    assert out == reference and stats["num_accepted_tokens"] == 0
    assert 0 < stats["num_drafts"] <= 10  # of 98 decode steps that could draft
    # The request's own continuation: every decode step drafts and every draft is accepted.
    out, stats = run(lambda tokens, k, *_: reference[len(tokens) - len(prompt):][:k])
    assert out == reference
    assert stats["num_accepted_tokens"] == stats["num_draft_tokens"] == len(reference) - 1 - stats["num_drafts"]


def test_what_speculates_and_what_is_refused():
    assert speculates(SamplingParams(temperature=1.0, top_p=0.5, min_p=0.1, presence_penalty=1.0, logit_bias={1: 2.0},
                                     allowed_token_ids=[1, 2], min_tokens=3, n=2, seed=3))
    assert speculates(SamplingParams(temperature=1.0, logprobs=0))  # each verified token's row reports them
    assert not speculates(SamplingParams(structured_outputs=GrammarSpec.of("regex", "a+")))  # the matcher
    assert not speculates(SamplingParams(pooling="mean"))


def _stream(req_id: str, output: list[int], params: SamplingParams) -> CachedRequestState:
    return CachedRequestState(NewRequestData(req_id, 0, [1], list(output), params, [], 0))


def test_a_stream_whose_draft_row_leaves_no_token_is_verified_as_a_plain_decode_alone():
    # Token 2 after 3 is allowed, but after 3, 2 both allowed tokens complete a bad word: the second
    # row leaves nothing. The stream gets its plain decode's token (drafts rejected, as if it had
    # decoded one token), and the greedy stream beside it is verified as ever.
    bad = _stream("bad", [3], SamplingParams(temperature=1.0, seed=1, allowed_token_ids=[2, 3],
                                             bad_words_token_ids=[[2, 2], [2, 3]]))
    greedy = _stream("greedy", [0], SamplingParams(temperature=0.0))
    logits = torch.full((5, 6), -5.0)
    logits[0, 2] = logits[1, 2] = logits[2, 2] = logits[3, 4] = logits[4, 5] = 20.0
    verifier = step_outputs.StepOutputs(Sampler([], seed=0, device=torch.device("cpu")), None, None)
    out = ModelRunnerOutput()
    verifier.verify(out, logits, [(bad, [2, 2]), (greedy, [4])])
    assert out.verified == [("bad", [2], [None]), ("greedy", [4, 5], [None, None])] and out.failed == []
