"""Speculative decoding (prompt lookup, greedy verification): the tokens are the model's own,
token for token (transformers' greedy, and the engine without speculation), while drafts are
accepted; stops act inside an accepted run; rejected drafts' blocks go back to the pool and never
into the prefix cache; what this engine does not speculate with is refused in one line."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core.ngram_proposer import propose
from tests.engine.hf_oracle import hf_greedy
from tests.server.server_harness import API_KEY, ServerProcess

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
# Tiny random models copy little, but a prompt of one or two repeated tokens sends them into short
# cycles that prompt lookup predicts; the random prompt gives drafts that are mostly rejected.
COPY_HEAVY = [[7] * 20, [100] * 20, [7, 8] * 10]


def _random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def _llm(path, spec: dict | None = SPEC, **config) -> LLM:
    return LLM(path, **{"device": "cpu", "dtype": "float32", "num_kv_blocks": 128, "max_model_len": 256,
                        "speculative_config": spec, **config})


def _greedy(llm: LLM, prompts, max_tokens: int, **params) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_prompt_lookup_proposes_what_followed_the_most_recent_longest_match():
    # [2, 3] (the longest suffix of length <= 3 found earlier) last occurred at 4..5, followed by 9, 2, 3.
    assert propose([1, 2, 3, 4, 2, 3, 9, 2, 3], k=3, min_n=1, max_n=3) == [9, 2, 3]
    assert propose([1, 2, 3, 4, 2, 3], k=2, min_n=2, max_n=3) == [4, 2]
    assert propose([1, 2, 3, 4], k=4, min_n=1, max_n=3) == []  # 4 never occurred before
    assert propose([5, 1, 2, 6, 2], k=3, min_n=2, max_n=3) == []  # only a 1-gram recurs
    # An occurrence that ends near the end (it may overlap the suffix): its period repeats.
    assert propose([9, 9, 9], k=5, min_n=1, max_n=2) == [9, 9, 9, 9, 9]
    assert propose([4, 1, 2, 3, 1, 2, 3], k=5, min_n=1, max_n=3) == [1, 2, 3, 1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_greedy_tokens_equal_transformers_and_no_speculation_with_drafts_accepted(family, tiny_models):
    path = tiny_models(family)
    prompts = COPY_HEAVY + [_random_prompt(40, seed=1)]
    # A 16-token step budget chunks the 40-token prompt and bounds the verify rows of a step.
    llm = _llm(path, max_num_batched_tokens=16)
    try:
        outs = _greedy(llm, prompts, 40)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert stats["num_accepted_tokens"] > 0 and stats["num_draft_tokens"] > stats["num_accepted_tokens"]
    assert stats["num_chunked_prefills"] > 0
    assert sum(stats["num_accepted_tokens_per_pos"]) == stats["num_accepted_tokens"]
    assert stats["num_drafts"] >= stats["num_accepted_tokens_per_pos"][0] > 0
    assert stats["num_used_blocks"] == 0
    plain = _llm(path, spec=None, max_num_batched_tokens=16)
    try:
        assert _greedy(plain, prompts, 40) == outs
    finally:
        plain.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out == hf_greedy(path, prompt, 40), prompt[:4]


def _run_to_end(llm: LLM, prompt: list[int], params: SamplingParams) -> list:
    core = llm.engine
    core.add_request("r", prompt, params)
    outputs = []
    while core.has_unfinished_requests():
        outputs += [o for o in core.step() if o.request_id == "r"]
    return outputs


def test_a_stop_token_inside_an_accepted_run_ends_the_output_there(tiny_models):
    path = tiny_models("llama")
    # The tiny Llama's own continuation of [368] * 20, quoted after it: continuing this, it copies
    # 227, 458 from the quote in one verify step, and 458 (the stop) occurs there first.
    prompt = [368] * 20 + [458, 458, 104, 19, 458, 104, 79, 458, 256, 227, 458, 209] + [368] * 4 + [458, 458]
    reference = hf_greedy(path, prompt, 30)
    llm = _llm(path)
    try:
        outputs = _run_to_end(llm, prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                          stop_token_ids=[458]))
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert tokens == reference[:reference.index(458) + 1]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == ("stop", 458)
    assert len(outputs[-1].new_token_ids) > 1  # the stop came with the tokens a verify step accepted
    # Tokens the verify steps produced (per output, its accepted drafts plus one) beyond those
    # emitted: the ones after the stop were dropped.
    assert len(outputs) + stats["num_accepted_tokens"] > len(tokens)
    assert stats["num_used_blocks"] == 0


def test_max_tokens_and_the_context_window_end_a_speculating_output_exactly(tiny_models):
    path = tiny_models("llama")
    prompt = [100] * 20
    llm = _llm(path, max_model_len=33)
    try:
        short = _greedy(llm, [prompt], 9)[0]
        window = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
        assert llm.engine.stats()["num_accepted_tokens"] > 0
    finally:
        llm.shutdown()
    reference = hf_greedy(path, prompt, 13)
    assert short == reference[:9]
    assert (window.token_ids, window.finish_reason) == (reference, "length")  # 20 + 13 = max_model_len


def test_preemption_and_a_mixed_batch_keep_every_output(tiny_models):
    path = tiny_models("llama")
    greedy = COPY_HEAVY + [_random_prompt(30, seed=2)]
    others = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, presence_penalty=0.5),  # penalised drafts
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1),  # logprobs of verified rows
        SamplingParams(temperature=1.0, top_k=20, seed=5, max_tokens=40, ignore_eos=True),  # sampled drafts
    ]
    prompts = greedy + [[100] * 20] * len(others)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(greedy) + others

    def run(spec):
        # 14 blocks of 16 tokens for 7 sequences of up to 70: they cannot all stay, so some are preempted.
        llm = _llm(path, spec=spec, num_kv_blocks=14, block_size=16, max_model_len=80)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            return [o.outputs[0].token_ids for o in outs], llm.engine.stats()
        finally:
            llm.shutdown()

    with_spec, stats = run(SPEC)
    assert stats["num_preemptions"] > 0 and stats["num_accepted_tokens"] > 0
    assert stats["num_used_blocks"] == 0
    assert with_spec == run(None)[0]
    for prompt, out in zip(greedy, with_spec):
        assert out == hf_greedy(path, prompt, 40)


def test_rejected_drafts_blocks_are_freed_and_never_cached(tiny_models):
    path = tiny_models("llama")
    # Eight drafts a step in blocks of 8 tokens: a rejected run often reaches into a block of its own.
    llm = _llm(path, spec={**SPEC, "num_speculative_tokens": 8}, block_size=8)
    core = llm.engine
    kv = core.scheduler.kv
    try:
        # The tiny Llama cycles on each of these for a while, then leaves the cycle: drafts rejected.
        prompts = [[309, 310] * 10, [453] * 20, [471, 472] * 10, [100] * 20]
        for i, prompt in enumerate(prompts):
            core.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
        outputs: dict[str, list[int]] = {}
        for _ in range(16):
            for o in core.step():
                outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            for req in core.scheduler.running:  # a block beyond the computed tokens held only rejected drafts
                assert len(req.block_ids) == kv.blocks_needed(req.num_computed_tokens)
        stats = core.stats()
        assert stats["num_draft_tokens"] > stats["num_accepted_tokens"] > 0
        core.abort_request([f"r{i}" for i in range(len(prompts))])  # in the middle of speculating
        core.step()
        assert core.stats()["num_used_blocks"] == 0
        # The aborted streams' full blocks are in the prefix cache: a prompt made of a stream's tokens
        # reuses them, and its output is still transformers' own.
        prompt = prompts[0] + outputs["r0"]
        out = _greedy(llm, [prompt], 8)[0]
        assert core.stats()["prefix_cache_hits"] >= 4 * 8
    finally:
        llm.shutdown()
    assert out == hf_greedy(path, prompt, 8)


@pytest.mark.parametrize("spec, says", [
    ({"method": "suffix", "num_speculative_tokens": 4}, "speculative_config: draft-model speculation (suffix) is not"),
    ({"method": "medusa2", "num_speculative_tokens": 4}, "speculative_config method must be 'ngram', got 'medusa2'"),
    ({"model": "some/draft", "num_speculative_tokens": 4}, "draft-model speculation (model) is not supported yet"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in 1..15, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 16}, "num_speculative_tokens must be an integer in 1..15, got 16"),
    ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
     "prompt_lookup_min (5) must be <= prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 4, "draft_tensor_parallel_size": 1},
     "unknown key(s) draft_tensor_parallel_size"),
    ("{method: ngram}", "speculative_config is not valid JSON"),
])
def test_a_bad_speculative_config_is_one_line(spec, says):
    with pytest.raises(ValueError) as e:
        EngineConfig(speculative_config=spec)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"])
def test_speculation_with_parallel_ranks_is_refused_in_one_line(parallel):
    with pytest.raises(ValueError, match=rf"^speculative_config is not supported with {parallel} > 1 yet"):
        EngineConfig(speculative_config=SPEC, **{parallel: 2})


def test_the_flag_takes_vllms_json_and_says_a_bad_one_in_one_line():
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}')
    assert config.speculative_config == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                         "prompt_lookup_min": 2}
    done = subprocess.run([sys.executable, "-m", "engine", "generate", "hi", "--device", "cpu",
                           "--speculative-config", '{"method": "eagle3", "model": "x"}'],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["engine generate: error: speculative_config: draft-model speculation (eagle3) "
                                        "is not supported yet: use {\"method\": \"ngram\"} (prompt lookup)"]


@pytest.mark.slow
def test_a_server_streams_verified_tokens_and_exports_the_counters(tiny_models, tmp_path):
    import json

    import openai

    from transformers import AutoTokenizer

    from tests.server.server_harness import get_metrics, metric

    path = tiny_models("llama")
    prompt = [100] * 20
    text = AutoTokenizer.from_pretrained(path).decode(hf_greedy(path, prompt, 30))
    server = ServerProcess(["--model", path, "--num-kv-blocks", "128", "--num-threads", "1", "--api-key", API_KEY,
                            "--speculative-config", json.dumps(SPEC)], str(tmp_path / "server.log"))
    try:
        with openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60) as client:
            body = dict(model=client.models.list().data[0].id, prompt=prompt, max_tokens=30, temperature=0,
                        extra_body={"ignore_eos": True})
            whole = client.completions.create(**body).choices[0].text
            deltas = [c.choices[0].text for c in client.completions.create(**body, stream=True) if c.choices]
        counters = get_metrics(server)
    finally:
        server.stop()
    assert whole == "".join(deltas) == text
    assert len(deltas) < 30  # verified tokens come several to a delta
    accepted = metric(counters, "pagewise:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= metric(counters, "pagewise:spec_decode_num_draft_tokens_total")
    assert metric(counters, "pagewise:spec_decode_num_drafts_total") > 0


def test_verified_tokens_report_the_logprobs_decoding_reports(tiny_models):
    """A speculating request with logprobs gets, for each accepted draft and the model's own token, the
    logprob and top logprobs of its verify row: what the same request gets decoding token by token."""
    path = tiny_models("llama")
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3)

    def run(spec):
        llm = _llm(path, spec=spec)
        try:
            outs = llm.generate(COPY_HEAVY, params, use_tqdm=False)
            return [o.outputs[0] for o in outs], llm.engine.stats()
        finally:
            llm.shutdown()

    (fast, stats), (plain, _) = run(SPEC), run(None)
    assert stats["num_accepted_tokens"] > 0
    for a, b in zip(fast, plain):
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(b.logprobs) == 30
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x)
