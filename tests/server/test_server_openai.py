"""The official `openai` client against a real server: completions, chat, streaming, n, logprobs,
usage, stop sequences, echo, and the info endpoints."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from tests.server.server_harness import get_metrics, metric

PROMPT = "The capital of France is"
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of France?"}]


def test_models_health_version(server, client):
    models = client.models.list()
    assert len(models.data) == 1 and models.data[0].object == "model"
    name = models.data[0].id
    assert client.models.retrieve(name).id == name
    assert httpx.get(server.url + "/health").status_code == 200  # open without the key
    v = httpx.get(server.url + "/version", headers={"Authorization": "Bearer test-key-123"})
    assert v.status_code == 200 and v.json()["version"]


def test_completion_basic_usage_and_greedy_determinism(client):
    model = client.models.list().data[0].id
    a = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    b = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert a.id.startswith("cmpl-") and a.object == "text_completion" and a.model == model and a.created > 0
    assert a.choices[0].text == b.choices[0].text  # greedy is deterministic
    assert a.choices[0].finish_reason in ("length", "stop")
    assert a.usage.prompt_tokens > 0 and 0 < a.usage.completion_tokens <= 12
    assert a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens


def test_completion_prompt_forms(client):
    model = client.models.list().data[0].id
    single = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0)
    many = client.completions.create(model=model, prompt=[PROMPT, "Hello world"], max_tokens=5, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == single.choices[0].text
    ids = client.completions.create(model=model, prompt=[5, 17, 42, 99], max_tokens=5, temperature=0)
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens >= 1
    two_id_lists = client.completions.create(model=model, prompt=[[5, 17], [42, 99, 7]], max_tokens=3,
                                             temperature=0)
    assert len(two_id_lists.choices) == 2 and two_id_lists.usage.prompt_tokens == 5


def test_completion_n2_and_seed(client):
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 16  # both choices counted
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded sampling repeats


def _same_when_streamed(client, model, whole, **kw) -> bool:
    """The same request streamed gives the whole response's tokens, logprobs and text offsets."""
    chunks = [c.choices[0] for c in client.completions.create(model=model, prompt=PROMPT, temperature=0, stream=True,
                                                               **kw) if c.choices and c.choices[0].logprobs]
    got = {name: sum((getattr(c.logprobs, name) for c in chunks), []) for name in ("tokens", "text_offset")}
    lp = whole.choices[0].logprobs
    assert got == {"tokens": lp.tokens, "text_offset": lp.text_offset}, (got, lp)
    assert "".join(c.text for c in chunks) == whole.choices[0].text
    return True


def test_streamed_text_offsets_are_the_whole_responses(client):
    """Streamed, text_offset counts the token texts before each token, as the whole response does:
    not the characters sent so far, which a stop string's hold-back and echo's prompt made differ."""
    model = client.models.list().data[0].id
    for kw in (dict(max_tokens=10, logprobs=1, stop=["zzzzzzzzzz"]), dict(max_tokens=5, logprobs=2, echo=True,
                                                                         stop=["zzzzzzzzzz"])):
        whole = client.completions.create(model=model, prompt=PROMPT, temperature=0, **kw)
        assert _same_when_streamed(client, model, whole, **kw)


def test_completion_logprobs_and_echo(client):
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    # token strings render each partial UTF-8 byte as U+FFFD; the text, whole characters (and U+FFFD
    # only for an unfinished one it ends in)
    assert "".join(lp.tokens).replace("\ufffd", "") == r.choices[0].text.replace("\ufffd", "")
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 4  # ids sharing a text (partial bytes) share a key
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-5)  # greedy picks the best
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    echo = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1)
    assert _same_when_streamed(client, model, echo, max_tokens=4, echo=True, logprobs=1)
    assert echo.choices[0].text.startswith(PROMPT)
    elp = echo.choices[0].logprobs
    assert elp.token_logprobs[0] is None  # the first prompt token has no context to score it
    assert len(elp.tokens) == echo.usage.prompt_tokens + echo.usage.completion_tokens


def test_completion_stop_sequence(client):
    model = client.models.list().data[0].id
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0).choices[0].text
    stop = full[3:5]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop])
    cut = full[:full.index(stop)]
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"


def test_completion_streaming_with_usage(client):
    model = client.models.list().data[0].id
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.id == chunks[0].id for c in chunks)


def test_chat_basic_and_parts(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    parts = [{"role": "system", "content": "Answer briefly."},
             {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]
    r2 = client.chat.completions.create(model=model, messages=parts, max_completion_tokens=8, temperature=0)
    assert r2.choices[0].message.content == msg.content  # a single text part equals a string


def test_chat_n2_logprobs(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0, n=2,
                                       logprobs=True, top_logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content  # greedy: both the same
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens // 2
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert math.isclose(item.logprob, item.top_logprobs[0].logprob, abs_tol=1e-5)
    joined = b"".join(bytes(item.bytes) for item in content).decode("utf-8", errors="replace")
    assert joined.startswith(r.choices[0].message.content.rstrip("\ufffd"))


def test_chat_streaming_role_finish_and_usage(client):
    model = client.models.list().data[0].id
    full = client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_streaming_n2_stop(client):
    model = client.models.list().data[0].id
    full = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0)
    text = full.choices[0].message.content
    stop = text[4:6]
    if not stop.strip() or stop not in text:
        pytest.skip(f"no usable stop string in {text!r}")
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0, n=2,
                                                 stop=stop, stream=True))
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(ch.delta.content or "" for ch in mine) == text[:text.index(stop)]
        assert mine[-1].finish_reason == "stop"


def test_metrics_exposed(server, client):
    text = get_metrics(server)
    for name in ("pagewise:num_requests_running", "pagewise:num_requests_waiting", "pagewise:kv_cache_usage_perc",
                 "pagewise:num_used_kv_blocks", "pagewise:prefix_cache_hit_rate", "pagewise:prompt_tokens_total",
                 "pagewise:generation_tokens_total", "pagewise:time_to_first_token_seconds_bucket",
                 "pagewise:inter_token_latency_seconds_bucket", "pagewise:e2e_request_latency_seconds_count"):
        assert name in text, name
    assert metric(text, "pagewise:generation_tokens_total") > 0
    assert metric(text, "pagewise:requests_finished_total", finished_reason="length") > 0


def test_whole_and_streamed_responses_time_every_token(server, client):
    """A non-streamed response is built once from the engine's whole output, yet the latency
    histograms count it as they count a stream: one first token, a gap for each later token,
    one request."""
    model = client.models.list().data[0].id
    names = ("pagewise:time_to_first_token_seconds_count", "pagewise:inter_token_latency_seconds_count",
             "pagewise:e2e_request_latency_seconds_count")
    for stream in (False, True):
        before = get_metrics(server)
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, stream=stream,
                                        extra_body={"ignore_eos": True})
        if stream:
            text = "".join(chunk.choices[0].text for chunk in out if chunk.choices)
        else:
            text = out.choices[0].text
            assert out.usage.completion_tokens == 6
        after = get_metrics(server)
        assert text
        assert [metric(after, n) - (metric(before, n) or 0) for n in names] == [1, 5, 1], stream


def test_logit_bias_on_both_endpoints(client, tiny_model_dir):
    """+100 on one token makes it the only choice (OpenAI's semantics), sampled or greedy; the
    text is that token repeated, decoded by the model's own tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = client.models.list().data[0].id
    token = 42
    want = tok.decode([token] * 5)
    c = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=3,
                                  logit_bias={str(token): 100})
    assert c.choices[0].text == want and c.usage.completion_tokens == 5
    ch = client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0,
                                        logit_bias={str(token): 100})
    assert ch.choices[0].message.content == want
    # vLLM's allowed_token_ids: one allowed token is the only choice, on both endpoints too.
    c = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=3,
                                  extra_body={"allowed_token_ids": [token], "ignore_eos": True})
    assert c.choices[0].text == want
    ch = client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0,
                                        extra_body={"allowed_token_ids": [token], "ignore_eos": True})
    assert ch.choices[0].message.content == want
    # vLLM's bad_words: a word the greedy reply writes (its first token that is a whole printable
    # word, not a byte of one) is written up to there, and not there any more.
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0)
    tokens = plain.choices[0].logprobs.tokens
    at = next(i for i, t in enumerate(tokens) if t.strip().isalpha() and t.isascii() and t not in tokens[:i])
    banned = client.completions.create(model=model, prompt=PROMPT, max_tokens=at + 1, temperature=0, logprobs=0,
                                       extra_body={"bad_words": [tokens[at]]}).choices[0].logprobs.tokens
    assert banned[:at] == tokens[:at] and banned[at] != tokens[at]


def test_tokenize_and_detokenize_in_vllms_shapes(server, tiny_model_dir):
    """/tokenize gives what the generation routes feed the model (the usage counts agree, and the
    chat template's ids equal transformers' own); /detokenize is the tokenizer's decode."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    headers = {"Authorization": "Bearer test-key-123"}

    def post(path, body):
        r = httpx.post(server.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    t = post("/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert t["tokens"] == tok(PROMPT).input_ids and t["count"] == len(t["tokens"]) and t["max_model_len"] > 0
    assert t["token_strs"] == tok.convert_ids_to_tokens(t["tokens"])
    usage = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers=headers,
                       timeout=30).json()["usage"]
    assert usage["prompt_tokens"] == t["count"]
    c = post("/tokenize", {"messages": CHAT})
    want = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert c["tokens"] == tok(want, add_special_tokens=False).input_ids and c["token_strs"] is None
    chat_usage = httpx.post(server.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1},
                            headers=headers, timeout=30).json()["usage"]
    assert chat_usage["prompt_tokens"] == c["count"]
    bare = post("/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert bare["count"] < c["count"]
    assert post("/detokenize", {"tokens": t["tokens"]})["prompt"] == tok.decode(t["tokens"])


def test_chat_template_options_in_vllms_names(server, client, tiny_model_dir):
    """continue_final_message, add_generation_prompt and chat_template_kwargs reach the chat template
    as transformers' apply_chat_template takes them (its ids are the oracle: /tokenize, the usage
    counts), and a continued reply is what the same ids give as a plain completion."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = client.models.list().data[0].id
    headers = {"Authorization": "Bearer test-key-123"}

    def tokenize(body):
        r = httpx.post(server.url + "/tokenize", json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    prefilled = CHAT + [{"role": "assistant", "content": "The capital"}]
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    text = tok.apply_chat_template(prefilled, tokenize=False, **cont)
    assert text.endswith("The capital")  # left open: no end-of-turn after it
    ids = tok(text, add_special_tokens=False).input_ids
    assert tokenize({"messages": prefilled, **cont}) == ids
    r = client.chat.completions.create(model=model, messages=prefilled, max_tokens=6, temperature=0, extra_body=cont)
    plain = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == plain.choices[0].text

    think = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert think.endswith("<think>\n\n</think>\n\n")  # the tiny template reads the variable, as Qwen3's does
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    think_ids = tok(think, add_special_tokens=False).input_ids
    assert tokenize({"messages": CHAT, **kwargs}) == think_ids
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=1, extra_body=kwargs)
    assert r.usage.prompt_tokens == len(think_ids) > len(tokenize({"messages": CHAT}))


def test_embeddings_with_the_official_client(server, client, tiny_model_dir):
    """client.embeddings.create (which asks for base64 and decodes it) and a float request over
    plain HTTP both give transformers' last final hidden state, normalised, per input."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    model = client.models.list().data[0].id
    inputs = [PROMPT, "Hello world, again"]
    r = client.embeddings.create(model=model, input=inputs)
    assert [d.index for d in r.data] == [0, 1] and r.model == model
    ids = [tok(t).input_ids for t in inputs]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    for d, x in zip(r.data, ids):
        with torch.no_grad():
            h = hf.model(torch.tensor([x])).last_hidden_state[0, -1].double()
        torch.testing.assert_close(torch.tensor(d.embedding, dtype=torch.float64), h / h.norm(), atol=2e-5, rtol=1e-4)
    plain = httpx.post(server.url + "/v1/embeddings", json={"input": [ids[0]], "encoding_format": "float"},
                       headers={"Authorization": "Bearer test-key-123"}, timeout=30).json()
    assert plain["object"] == "list" and plain["data"][0]["object"] == "embedding"
    torch.testing.assert_close(torch.tensor(plain["data"][0]["embedding"]), torch.tensor(r.data[0].embedding))
    mean = client.embeddings.create(model=model, input=PROMPT, extra_body={"pooling": "mean"}).data[0].embedding
    with torch.no_grad():
        h = hf.model(torch.tensor([ids[0]])).last_hidden_state[0].double().mean(0)
    torch.testing.assert_close(torch.tensor(mean, dtype=torch.float64), h / h.norm(), atol=2e-5, rtol=1e-4)


COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
         "required": ["color", "ok"], "additionalProperties": False}


def test_structured_output_through_every_door(client):
    """response_format json_schema (streamed and not, n=2), vLLM's structured_outputs and its
    older guided_* fields: each output follows its constraint (jsonschema / the regex as oracle),
    even from the tiny random model."""
    import re

    import jsonschema

    model = client.models.list().data[0].id
    fmt = {"type": "json_schema", "json_schema": {"name": "color", "schema": COLOR, "strict": True}}
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=40, temperature=1.0, seed=2, n=2,
                                       response_format=fmt)
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), COLOR)
    stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=40, temperature=0,
                                            response_format=fmt, stream=True)
    jsonschema.validate(json.loads("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)), COLOR)
    c = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=5,
                                  extra_body={"structured_outputs": {"regex": "[a-c]{2}-[0-9]"}})
    assert re.fullmatch("[a-c]{2}-[0-9]", c.choices[0].text)
    g = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=5,
                                  extra_body={"guided_choice": ["left", "right"]})
    assert g.choices[0].text in ("left", "right")
