"""Sampling: seeds reproduce, greedy equivalences, penalty formulas on hand-made logits, the
sampled distribution, and logprobs against transformers' own logits."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine import SamplingParams
from engine.runner.model_runner import CachedRequestState
from engine.runner.sampler import PenaltyState, Sampler, apply_penalties, filter_logits
from engine.scheduler_output import NewRequestData
from tests.engine.hf_oracle import hf_greedy, hf_logits
from tests.engine.sampling_reference import kept_tokens, penalise_row


def _stream(prompt: list[int], params: SamplingParams) -> CachedRequestState:
    """A stream as the runner holds it: what the sampler reads and keeps."""
    return CachedRequestState(NewRequestData("r#0", 0, list(prompt), [], params, [], 0))

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
    t0 = _tokens(tiny_llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                                   use_tqdm=False))
    k1 = _tokens(tiny_llm.generate(PROMPTS, SamplingParams(temperature=1.3, top_k=1, max_tokens=10, seed=5,
                                                            ignore_eos=True), use_tqdm=False))
    assert t0 == expected and k1 == expected


def _penalise(logits, prompt, output, presence, frequency, repetition):
    state = PenaltyState(_stream(prompt, SamplingParams()), logits.shape[-1], torch.device("cpu"))
    state.output_counts.zero_()
    state.frequency, state.presence = frequency, presence
    state.subtract.zero_()
    for t in output:
        state.add(t)
    return apply_penalties(logits[None].clone(), state.seen[None], state.subtract[None], torch.tensor([repetition]))[0]


def test_penalties_follow_their_formulas():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -0.2])
    prompt, output = [0, 4], [1, 1, 2]
    got = _penalise(logits, prompt, output, presence=0.5, frequency=0.25, repetition=2.0)
    # Repetition (seen anywhere): positive / 2, negative * 2. Then OpenAI's on output counts.
    expected = [2.0 / 2, -1.0 * 2 - (0.25 * 2 + 0.5), 0.5 / 2 - (0.25 * 1 + 0.5), 3.0, -0.2 * 2]
    assert got.tolist() == pytest.approx(expected)
    assert torch.equal(_penalise(logits, prompt, output, 0.0, 0.0, 1.0), logits)


def test_filters_keep_the_documented_sets():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))

    def kept(top_k, top_p, min_p):
        out = filter_logits(logits[None], torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))[0]
        return (~torch.isinf(out)).nonzero().flatten().tolist()

    assert kept(2, 1.0, 0.0) == [0, 1]
    assert kept(0, 0.8, 0.0) == [0, 1, 2]  # 0.5+0.2 < 0.8 <= +0.15
    assert kept(0, 0.7, 0.0) == [0, 1]
    assert kept(0, 1.0, 0.3) == [0, 1, 2]  # p >= 0.3 * 0.5


def test_batched_filters_and_penalties_equal_the_row_by_row_definitions():
    """Random batches, each row with its own settings, against the float64 oracle."""
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for _ in range(30):
        batch, vocab = rng.randint(1, 6), rng.randint(2, 40)
        logits = torch.randn(batch, vocab, generator=gen) * 3
        top_k = [rng.choice([0, 1, 2, 5, vocab + 3]) for _ in range(batch)]
        top_p = [rng.choice([1.0, 0.9, 0.5, 0.05]) for _ in range(batch)]
        min_p = [rng.choice([0.0, 0.05, 0.3]) for _ in range(batch)]
        got = filter_logits(logits.clone(), torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p))
        for row in range(batch):
            kept = set((~torch.isinf(got[row])).nonzero().flatten().tolist())
            assert kept == kept_tokens(logits[row], top_k[row], top_p[row], min_p[row]), (row, top_k, top_p, min_p)
        prompt = [rng.randrange(vocab) for _ in range(4)]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        pen = (rng.choice([0.0, 0.5, -1.0]), rng.choice([0.0, 0.3]), rng.choice([1.0, 1.5, 0.5]))
        assert _penalise(logits[0], prompt, output, *pen).double().tolist() == pytest.approx(
            penalise_row(logits[0], prompt, output, *pen).tolist(), abs=1e-5)


def test_top_p_over_a_large_vocabulary_equals_the_definition():
    """Peaked rows find their nucleus among the first candidates; flat rows need the full sort."""
    gen = torch.Generator().manual_seed(1)
    vocab = 2000
    logits = torch.randn(6, vocab, generator=gen) * torch.tensor([[8.0], [8.0], [4.0], [0.5], [0.1], [8.0]])
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.9, 0.99, 1.0])
    got = filter_logits(logits.clone(), torch.zeros(6, dtype=torch.long), top_p, torch.zeros(6))
    for row in range(6):
        kept = set((~torch.isinf(got[row])).nonzero().flatten().tolist())
        assert kept == kept_tokens(logits[row], 0, float(top_p[row]), 0.0), row


def test_extreme_but_valid_settings_sample(tiny_llm):
    """Found by the server fuzz: a top_k past int64 and a top_p that float32 rounds to 0 must
    sample (everything, and the argmax alone), not fail the request."""
    logits = torch.tensor([[0.1, 3.0, 0.2, 0.3]])
    sampler = Sampler([], seed=0, device=torch.device("cpu"))
    assert sampler(logits, [_stream([1], SamplingParams(temperature=1.0, top_p=1e-300))])[0].token_id == 1
    assert 0 <= sampler(logits, [_stream([1], SamplingParams(temperature=1.0, top_k=2**70))])[0].token_id < 4


def test_penalty_counts_follow_the_output_incrementally(tiny_llm):
    """The sampler's per-request counts, kept step by step, give the same tokens as counts rebuilt
    from scratch each step (a fresh engine run with the same seed has no carried state)."""
    p = SamplingParams(temperature=0.9, max_tokens=16, seed=3, ignore_eos=True, presence_penalty=0.8,
                       frequency_penalty=0.6, repetition_penalty=1.3)
    once = _tokens(tiny_llm.generate(PROMPTS, p, use_tqdm=False))
    assert once == _tokens(tiny_llm.generate(PROMPTS, p, use_tqdm=False))
    sampler = tiny_llm.engine.runner.sampler
    req = _stream(PROMPTS[0], p)
    req.output_token_ids = list(once[0][:5])
    state = PenaltyState(req, 512, torch.device("cpu"))
    assert state.output_counts.sum() == 5 and bool(state.seen[PROMPTS[0]].all())
    assert sampler is not None


def test_sampled_frequencies_match_softmax():
    probs = torch.tensor([0.05, 0.6, 0.25, 0.1])
    logits = torch.log(probs) * 0.5  # temperature 0.5 undoes the 0.5 scale
    sampler = Sampler([], seed=0, device=torch.device("cpu"))
    req = _stream([1], SamplingParams(temperature=0.5, seed=7))
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
    req = _stream([1], SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[4]))
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


def test_logit_bias_steers_greedy_generation_as_transformers_would(tiny_llm, tiny_models):
    """-100 on each step's argmax (from transformers' logits for the sequence so far) moves greedy
    decoding to the runner-up at every step; +100 on one token makes it the only choice, sampled
    or greedy, whatever else is in the batch."""
    path = tiny_models("llama")
    prompt = PROMPTS[0]
    first = int(hf_logits(path, prompt)[-1].argmax())
    banned = tiny_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logit_bias={first: -100}),
                               use_tqdm=False)[0].outputs[0].token_ids
    ref = hf_logits(path, prompt)[-1].double()
    ref[first] -= 100
    assert banned == [int(ref.argmax())] and banned != [first]
    forced = SamplingParams(temperature=1.0, seed=1, max_tokens=6, ignore_eos=True, logit_bias={42: 100.0})
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = tiny_llm.generate([prompt, PROMPTS[1]], [forced, plain], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [42] * 6
    assert outs[1].outputs[0].token_ids == hf_greedy(path, PROMPTS[1], 6)  # its neighbour is untouched


def test_allowed_token_ids_restrict_greedy_as_transformers_would(tiny_llm, tiny_models):
    """Greedy with allowed_token_ids takes, at every step, the best of those ids by transformers'
    logits for the sequence so far; a sampled stream stays inside them; its neighbour is untouched."""
    path = tiny_models("llama")
    prompt, allowed = PROMPTS[0], [3, 42, 77, 300, 511]
    seq = list(prompt)
    for _ in range(5):
        logits = hf_logits(path, seq)[-1]
        seq.append(allowed[int(logits[allowed].argmax())])
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, allowed_token_ids=allowed)
    sampled = SamplingParams(temperature=1.0, seed=2, max_tokens=20, ignore_eos=True, allowed_token_ids=allowed[:2])
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = tiny_llm.generate([prompt, prompt, PROMPTS[1]], [greedy, sampled, plain], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == seq[len(prompt):]
    assert set(outs[1].outputs[0].token_ids) <= set(allowed[:2])
    assert outs[2].outputs[0].token_ids == hf_greedy(path, PROMPTS[1], 6)


def _greedy_without(path: str, prompt: list[int], sequences: list[list[int]], steps: int) -> list[int]:
    """Greedy decoding by transformers' logits where a token that would complete one of `sequences`
    (the output so far ending with the rest of it) is never taken: vLLM's bad_words rule."""
    out: list[int] = []
    for _ in range(steps):
        logits = hf_logits(path, prompt + out)[-1].clone()
        for s in sequences:
            if len(s) == 1 or (len(out) >= len(s) - 1 and out[len(out) - len(s) + 1:] == s[:-1]):
                logits[s[-1]] = float("-inf")
        out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize("length", [1, 2])
def test_bad_words_steer_greedy_as_transformers_would(tiny_llm, tiny_models, length):
    """A bad word made of `length` tokens of the plain greedy output (the first such run whose text
    encodes back to them: banned as its own tokens and as spelled after a space) moves greedy
    decoding exactly where transformers' logits with its completions forbidden go."""
    path, tok = tiny_models("llama"), tiny_llm.tokenizer
    prompt = PROMPTS[0]
    plain = hf_greedy(path, prompt, 12)

    def spellings(word):
        return [tok(w, add_special_tokens=False).input_ids for w in (word.lstrip(), " " + word.lstrip())]

    start = next(i for i in range(len(plain) - length)
                 if plain[i:i + length] in spellings(tok.decode(plain[i:i + length])))
    word = tok.decode(plain[start:start + length])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, bad_words=[word])
    got = tiny_llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == _greedy_without(path, prompt, spellings(word), 12)
    assert got[:start + length] != plain[:start + length]  # the word it would have written is gone


@pytest.mark.parametrize("words", [[""], ["  "], ["x" * 257], ["w"] * 129, [5]])
def test_bad_words_are_checked(words):
    with pytest.raises(ValueError, match="^bad_words must be a list of at most 128 words"):
        SamplingParams(bad_words=words)


@pytest.mark.parametrize("ids", [[], [-1], [1.5], ["7"]])
def test_allowed_token_ids_are_checked(ids):
    with pytest.raises(ValueError, match="^allowed_token_ids must be None or a non-empty list"):
        SamplingParams(allowed_token_ids=ids)


def test_allowed_token_ids_outside_the_vocabulary_are_refused(tiny_llm):
    with pytest.raises(ValueError, match="^allowed_token_ids must name token ids in"):
        tiny_llm.generate([[1, 2, 3]], SamplingParams(allowed_token_ids=[5, 10**6]), use_tqdm=False)
    assert not tiny_llm.engine.parents


@pytest.mark.parametrize("bias, field", [({-1: 1.0}, "logit_bias"), ({5: 100.5}, "logit_bias"),
                                         ({5: float("nan")}, "logit_bias"), ({"5": 1.0}, "logit_bias")])
def test_logit_bias_is_checked(bias, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_outside_the_vocabulary_is_refused(tiny_llm):
    with pytest.raises(ValueError, match="^logit_bias must name token ids in"):
        tiny_llm.generate([[1, 2, 3]], SamplingParams(logit_bias={10**6: 5.0}), use_tqdm=False)
    assert not tiny_llm.engine.parents
