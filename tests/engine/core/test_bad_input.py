"""Bad input: a clear ValueError naming what to change, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.sampling_params import GrammarSpec, RequestError
from tests.engine.hf_oracle import hf_greedy

BAD_SAMPLING = [
    ("n", 0), ("n", 1000), ("max_tokens", 0), ("max_tokens", -5), ("min_tokens", -1),
    ("temperature", -0.1), ("temperature", 2.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
    ("repetition_penalty", 1e-300), ("seed", 1.5), ("seed", 2**63), ("seed", -2**63 - 1), ("seed", 2**64),
    ("stop", [""]), ("stop_token_ids", [-1]), ("logprobs", -1), ("prompt_logprobs", -1),
]


@pytest.mark.parametrize("field,value", BAD_SAMPLING)
def test_invalid_sampling_field_names_the_field(field, value):
    """A RequestError (still a ValueError, for callers of the offline API) carries the field, which
    its message starts with: a server renames it from `field`, never from the text."""
    with pytest.raises(RequestError) as caught:
        SamplingParams(**{field: value})
    assert isinstance(caught.value, ValueError) and caught.value.field == field
    assert str(caught.value).startswith(field) and caught.value.named("sent") == "sent" + str(caught.value)[len(field):]


def test_grammar_errors_name_the_field_they_came_in():
    with pytest.raises(RequestError) as caught:
        GrammarSpec.of("json", "{not json", field="guided_json")
    assert caught.value.field == "guided_json" and str(caught.value).startswith("guided_json: ")


def test_tiny_temperature_is_greedy():
    """As vLLM: below 1e-5 the temperature samples the argmax anyway (and 1/T overflows)."""
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy


def test_min_tokens_above_max_tokens():
    with pytest.raises(RequestError, match="^min_tokens") as caught:
        SamplingParams(min_tokens=10, max_tokens=5)
    assert caught.value.field == "min_tokens"


def test_bad_requests_leave_running_requests_untouched(tiny_llm, tiny_models):
    engine = tiny_llm.engine
    good = {"a": [5, 6, 7, 8], "b": list(range(20, 60))}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for rid, ids in good.items():
        engine.add_request(rid, ids, params)
    done = {}
    for out in engine.step():  # both are now running
        done.setdefault(out.request_id, []).extend(out.new_token_ids)
    bad = [
        ([], "empty"),
        ([5] * engine.max_model_len, "max_model_len"),
        ([engine.vocab_size + 5], "token ids"),
    ]
    for ids, message in bad:
        with pytest.raises(RequestError, match=message) as caught:
            engine.check_request(ids, params)  # what every front end runs once per request
        assert caught.value.field == "prompt"
    # Values SamplingParams cannot judge alone: the vocabulary and the engine's limits.
    for kwargs, field in [(dict(stop_token_ids=[engine.vocab_size], min_tokens=2), "^stop_token_ids"),
                          (dict(stop_token_ids=[2**70], min_tokens=1), "^stop_token_ids"),
                          (dict(logprobs=engine.config.max_logprobs + 1), "^logprobs"),
                          (dict(prompt_logprobs=engine.config.max_logprobs + 1), "^prompt_logprobs")]:
        with pytest.raises(RequestError, match=field) as caught:
            engine.check_request([5, 6], SamplingParams(max_tokens=4, **kwargs))
        assert caught.value.field == field[1:]
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [1, 2], params)
    with pytest.raises(ValueError, match="max_model_len"):
        tiny_llm.generate([[5, 6], [5] * engine.max_model_len], params, use_tqdm=False)
    while engine.has_unfinished_requests():
        for out in engine.step():  # each step: the new token of each running choice
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
    path = tiny_models("llama")
    # (the refused LLM.generate call's abort is reported too: it ended with no token)
    assert {rid: done[rid] for rid in good} == {rid: hf_greedy(path, ids, 8) for rid, ids in good.items()}
    assert engine.stats()["num_used_blocks"] == 0
    # And it still serves new work.
    assert (tiny_llm.generate([[9, 9, 9]], params, use_tqdm=False)[0].outputs[0].token_ids
            == hf_greedy(path, [9, 9, 9], 8))


def test_n_above_max_num_seqs_is_refused(tiny_models):
    """n choices run at once: more than max_num_seqs could never be scheduled together."""
    llm = LLM(tiny_models("llama"), device="cpu", num_kv_blocks=64, max_model_len=128, max_num_seqs=4)
    with pytest.raises(ValueError, match="^n must be at most max_num_seqs"):
        llm.generate([[5, 6]], SamplingParams(n=5, max_tokens=2), use_tqdm=False)
    outs = llm.generate([[5, 6]], SamplingParams(n=4, max_tokens=2, temperature=1.0, seed=1), use_tqdm=False)
    assert len(outs[0].outputs) == 4 and llm.engine.stats()["num_used_blocks"] == 0


def test_missing_model_path():
    with pytest.raises(ValueError, match="does not exist"):
        EngineConfig(model="/no/such/model")


def test_unknown_model_type_names_supported(tiny_models, tmp_path):
    folder = tmp_path / "weird"
    shutil.copytree(tiny_models("llama"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"gpt_neox.*llama.*qwen3"):
        LLM(str(folder), device="cpu")


@pytest.mark.parametrize("kwargs,field", [
    (dict(dtype="float64"), "dtype"), (dict(block_size=7), "block_size"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(attention_backend="cudnn"), "attention_backend"),
    # The Python API passes values as given (argparse converts the CLI's): these were torch or
    # comparison errors deep in start-up, or (True) a context of one token.
    (dict(seed=None), "seed must be an integer"), (dict(seed="1"), "seed must be an integer"),
    (dict(seed=10**30), "seed must be a 64-bit integer"), (dict(max_model_len="abc"), "max_model_len"),
    (dict(max_model_len=100.5), "max_model_len"), (dict(max_model_len=True), "max_model_len"),
    (dict(block_size=16.0), "block_size"), (dict(max_num_seqs=2.0), "max_num_seqs"),
    (dict(distributed_timeout_s=float("inf")), "distributed_timeout_s must be a finite number"),
    (dict(enable_prefix_caching=1), "enable_prefix_caching must be True or False"),
])
def test_invalid_engine_config(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def test_bad_offline_api_input_names_the_argument_and_leaves_nothing_queued(tiny_llm):
    """LLM's own arguments: a ValueError naming the prompt, message or sampling_params entry (they
    were TypeErrors, jinja2 errors, or defaults in silence), and nothing half-submitted stays (a
    request queued before a bad sampling_params entry was run at the next generate)."""
    sp = SamplingParams(max_tokens=2)
    cases = [
        (lambda: tiny_llm.generate(["a", "b"], [sp, {"max_tokens": 2}]), r"^sampling_params\[1\] must be"),
        (lambda: tiny_llm.generate(["a"], []), "got 0 sampling_params for 1 prompts"),
        (lambda: tiny_llm.generate(None), "^prompts must be"), (lambda: tiny_llm.generate(5), "^prompts must be"),
        (lambda: tiny_llm.generate((1, 2)), "^prompts must be"),
        (lambda: tiny_llm.generate([[True, 2]], sp), r"^prompts\[0\] must be"),
        (lambda: tiny_llm.chat([{"content": "hi"}]), r"^messages\[0\] must be a dict with a string 'role'"),
        (lambda: tiny_llm.chat([{"role": "user", "content": 5}]), r"^messages\[0\]\.content must be"),
        (lambda: tiny_llm.chat([[{"role": "user"}]]), r"^messages\[0\]\[0\]\.content must be"),
        (lambda: tiny_llm.chat("hello"), "^messages must be a conversation"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
        stats = tiny_llm.engine.stats()
        assert (stats["num_waiting"], stats["num_running"], stats["num_used_blocks"]) == (0, 0, 0), message


def test_prompt_shapes_vllm_takes(tiny_llm):
    """vLLM's dict prompts and OpenAI's text parts are the same requests as their plain forms; an
    embedding may fill the whole context (it generates nothing)."""
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    plain = tiny_llm.generate([[5, 6, 7], "hello"], sp, use_tqdm=False)
    shaped = tiny_llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt": "hello"}], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in shaped] == [o.outputs[0].token_ids for o in plain]
    text = tiny_llm.chat([{"role": "user", "content": "a\nb"}], sp, use_tqdm=False)[0]
    parts = tiny_llm.chat([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                          sp, use_tqdm=False)[0]
    assert parts.prompt_token_ids == text.prompt_token_ids and parts.outputs[0].token_ids == text.outputs[0].token_ids
    full = tiny_llm.engine.max_model_len
    assert len(tiny_llm.embed([[5] * full], use_tqdm=False)[0]) > 0
    with pytest.raises(ValueError, match="prompt has"):
        tiny_llm.embed([[5] * (full + 1)], use_tqdm=False)


def test_max_model_len_beyond_kv_cache_is_refused(tiny_models):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(tiny_models("llama"), device="cpu", num_kv_blocks=4, max_model_len=256)
