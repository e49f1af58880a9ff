"""LoRA adapters through a real server and the official openai client, vLLM's interface: --lora-modules
(both forms), /v1/models listing each adapter with its parent, a request's model selecting one,
return_token_ids, adapters loaded and unloaded while eight streams run, and the errors (an unknown
adapter 404, a bad folder 400 naming the field, the server healthy after). Tokens are checked against
transformers + PEFT generating each adapter alone."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from tests.engine.lora_adapters import build_adapter, peft_greedy
from tests.server.server_harness import ServerProcess, metric
from tests.tiny_model import build_tiny_model

BASE = "tiny-base"  # the served model's name
PROMPT = [5, 17, 33, 9, 100, 41, 7, 8, 9, 10, 11, 12]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    base = build_tiny_model(root / "base", model_type="llama", num_attention_heads=4, num_key_value_heads=2)
    paths = {
        "sql": build_adapter(base, root / "sql", 8, ["q_proj", "v_proj"], seed=1),
        "chat": build_adapter(base, root / "chat", 4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"], seed=2),
        "code": build_adapter(base, root / "code", 16, ["gate_proj", "up_proj", "down_proj"], alpha=8, seed=3),
        "late": build_adapter(base, root / "late", 12, ["o_proj", "down_proj"], seed=4),
    }
    chat_module = json.dumps({"name": "chat", "path": paths["chat"], "base_model_name": "tiny"})
    proc = ServerProcess(["--model", base, "--served-model-name", BASE, "--dtype", "float32",
                          "--num-kv-blocks", "256", "--num-threads", "1", "--enable-lora", "--max-loras", "2",
                          "--max-lora-rank", "16", "--enable-runtime-lora",
                          "--lora-modules", f"sql={paths['sql']}", chat_module, f"code={paths['code']}"],
                         str(root / "server.log"))
    yield proc, base, paths
    proc.stop()


def _client(proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.base_url, api_key="none", max_retries=0, timeout=120)


def _completion_ids(client, model: str) -> list[int]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = out.choices[0]
    assert out.model == model and choice.prompt_token_ids == PROMPT
    return choice.token_ids


def test_models_lists_the_adapters_with_their_parent(lora_server):
    proc, base, paths = lora_server
    with _client(proc) as client:
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {BASE, "sql", "chat", "code"}
        assert models["sql"].parent == BASE and models["sql"].root == paths["sql"]
        assert models[BASE].parent is None
        assert client.models.retrieve("chat").parent == BASE


def test_concurrent_requests_for_different_adapters_equal_peft(lora_server):
    proc, base, paths = lora_server
    names = [BASE, "sql", "chat", "code"] * 2  # three adapters, two slots: some wait for one
    results: dict[int, list[int]] = {}

    def run(i: int, name: str) -> None:
        with _client(proc) as client:
            results[i] = _completion_ids(client, name)

    threads = [threading.Thread(target=run, args=(i, n)) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, name in enumerate(names):
        assert results[i] == peft_greedy(base, paths.get(name), PROMPT, MAX_TOKENS), name
    assert len({tuple(results[i]) for i in range(4)}) == 4
    with _client(proc) as client:  # chat through an adapter, streamed, with the ids of each chunk
        stream = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4, temperature=0, stream=True,
                                                extra_body={"ignore_eos": True, "return_token_ids": True})
        chunks = list(stream)
    assert chunks[0].prompt_token_ids and all(c.model == "sql" for c in chunks)
    assert sum(len(c.choices[0].token_ids or []) for c in chunks if c.choices) == 4


def test_adapters_load_and_unload_while_streams_run(lora_server):
    proc, base, paths = lora_server
    errors: list[BaseException] = []
    done = []

    def stream(name: str) -> None:
        try:
            with _client(proc) as client:
                pieces = list(client.completions.create(model=name, prompt=PROMPT, max_tokens=48, temperature=0,
                                                        stream=True, extra_body={"ignore_eos": True}))
            done.append(sum(1 for p in pieces if p.choices and p.choices[0].text is not None))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=stream, args=([BASE, "sql", "chat", "sql"][i % 4],)) for i in range(8)]
    for t in threads:
        t.start()
    with httpx.Client(base_url=proc.url, timeout=60) as http:
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": paths["late"]})
        assert loaded.status_code == 200, loaded.text
        with _client(proc) as client:
            assert _completion_ids(client, "late") == peft_greedy(base, paths["late"], PROMPT, MAX_TOKENS)
        again = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": paths["late"]})
        assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
        for t in threads:
            t.join()
        assert not errors and len(done) == 8
        with _client(proc) as client:
            with pytest.raises(openai.NotFoundError) as caught:
                client.completions.create(model="late", prompt=PROMPT, max_tokens=2)
        assert caught.value.body["code"] == "model_not_found"
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
        text = http.get("/metrics").text
        assert metric(text, "pagewise:num_used_kv_blocks") == 0
        assert metric(text, "pagewise:lora_requests_total", lora_name="sql") >= 2
        assert http.get("/health").status_code == 200


def test_a_bad_adapter_folder_is_a_400_naming_the_path_and_the_server_serves_on(lora_server, tmp_path):
    proc, base, paths = lora_server
    dora = build_adapter(base, tmp_path / "dora", 4, ["q_proj"], use_dora=True)
    with httpx.Client(base_url=proc.url, timeout=60) as http:
        for path, why in ((dora, "DoRA"), (str(tmp_path / "nowhere"), "no such folder")):
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "lora_path" and why in error["message"]
        assert http.get("/v1/models").json()["data"][-1]["id"] != "bad"
    with _client(proc) as client:
        assert _completion_ids(client, "sql") == peft_greedy(base, paths["sql"], PROMPT, MAX_TOKENS)
