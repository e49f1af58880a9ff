"""The model's generation_config.json sampling settings (vLLM's --generation-config auto) reach the
requests that leave them unset, through a real server and the official client; a request's own
value wins."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.server.server_harness import API_KEY, TINY_SERVER_ARGS, ServerProcess

ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow  # starts its server (~5 s)
def test_the_models_sampling_defaults_apply_where_a_request_sets_none(tiny_model_dir, tmp_path):
    from openai import OpenAI

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    # Greedy and three tokens, where the API's own defaults are temperature 1 and the whole window.
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    proc = ServerProcess(["--model", str(folder), "--api-key", API_KEY, *TINY_SERVER_ARGS], str(tmp_path / "log"))
    try:
        client = OpenAI(base_url=proc.base_url, api_key=API_KEY)
        model = client.models.list().data[0].id
        eos = {"ignore_eos": True}
        plain = [client.chat.completions.create(model=model, messages=ASK, extra_body=eos) for _ in range(2)]
        greedy = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=3,
                                                extra_body=eos)
        # Sampling at temperature 1 over the tiny model's 512 near-uniform tokens would not repeat greedy's text.
        assert [p.choices[0].message.content for p in plain] == [greedy.choices[0].message.content] * 2
        assert [p.usage.completion_tokens for p in plain] == [3, 3]
        own = client.chat.completions.create(model=model, messages=ASK, max_tokens=5, extra_body=eos)
        assert own.usage.completion_tokens == 5
    finally:
        proc.stop()
