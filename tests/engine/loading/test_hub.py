"""Hub ids: `--model ORG/NAME` is read from a Hugging Face cache that huggingface_hub itself wrote
(from a Hub on a local socket, tests/engine/loading/fake_hub.py), offline; a revision resolves through
the cache's refs as huggingface_hub resolves it; an id the cache lacks is one line saying what to run;
a download fetches config, tokenizer and safetensors files only; the model's generation_config.json
gives the sampling defaults of a request that sets none."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from huggingface_hub import snapshot_download

from engine.cli import main
from engine.config import EngineConfig
from engine.loading import hub
from engine.loading.loader import source_for
from engine.loading.sampling_defaults import SamplingDefaults
from tests.engine.hf_oracle import hf_greedy
from tests.engine.loading.fake_hub import FakeHub, folder_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
REPO = "org/tiny"
BF16_REPO = "org/tiny-bf16"  # the same files, its config.json recording bfloat16 weights
MAIN, V2 = hashlib.sha1(b"main").hexdigest(), hashlib.sha1(b"v2").hexdigest()
# A model card's recommended sampling, as generation_config.json carries it (transformers' keys).
GENERATION_CONFIG = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 7, "min_p": 0.05,
                     "repetition_penalty": 1.3, "max_new_tokens": 5, "bos_token_id": 0, "eos_token_id": 1}
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny_model_dir) -> str:
    """An HF_HOME whose cache huggingface_hub wrote: org/tiny's main branch is the tiny Llama, its tag
    v2 the same with a generation_config.json."""
    home = str(tmp_path_factory.mktemp("hf-home"))
    files = folder_files(tiny_model_dir)
    v2 = {**files, "generation_config.json": json.dumps(GENERATION_CONFIG).encode()}
    bf16 = {**files, "config.json": json.dumps({**json.loads(files["config.json"]), "dtype": "bfloat16"}).encode()}
    with FakeHub({REPO: {"main": (MAIN, files), "v2": (V2, v2)}, BF16_REPO: {"main": (MAIN, bf16)}}) as fake:
        for repo, revision in ((REPO, "main"), (REPO, "v2"), (BF16_REPO, "main")):
            snapshot_download(repo, revision=revision, cache_dir=os.path.join(home, "hub"), endpoint=fake.url)
    return home


@pytest.fixture
def offline(monkeypatch, hf_home):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", hf_home)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hf_home


def _env(hf_home: str, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    return {**env, "HF_HOME": hf_home, "HF_HUB_OFFLINE": "1", **extra}


@pytest.mark.slow
def test_engine_generate_runs_a_hub_id_from_the_cache_offline(hf_home, tiny_model_dir):
    done = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", REPO, PROMPT, "--max-tokens", "6",
                           "--ignore-eos", "--device", "cpu", "--kv-cache-memory", "16MiB"], cwd=ROOT,
                          env=_env(hf_home), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = hf_greedy(tiny_model_dir, tokenizer(PROMPT)["input_ids"], 6)
    assert done.stdout.splitlines() == [PROMPT + tokenizer.decode(expected, skip_special_tokens=True)]


def test_an_id_the_cache_lacks_offline_is_one_line_saying_what_to_run(hf_home):
    done = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", "org/absent", PROMPT,
                           "--device", "cpu"], cwd=ROOT, env=_env(hf_home), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"engine generate: error: --model org/absent: neither a local path nor in the Hugging Face cache "
        f"({os.path.join(hf_home, 'hub', 'models--org--absent')}) and HF_HUB_OFFLINE is set, so nothing is "
        "downloaded: run `hf download org/absent`, or unset HF_HUB_OFFLINE to let the engine download it"]


@pytest.mark.parametrize("revision, commit", [(None, MAIN), ("main", MAIN), ("v2", V2), (V2, V2), (MAIN, MAIN)])
def test_a_revision_resolves_through_the_cache_refs_as_huggingface_hub_does(offline, revision, commit):
    found = hub.model_path(EngineConfig(model=REPO, revision=revision))
    assert found == snapshot_download(REPO, revision=revision, cache_dir=os.path.join(offline, "hub"),
                                      local_files_only=True)
    assert os.path.basename(found) == commit


def test_a_revision_the_cache_lacks_offline_says_what_to_run(offline):
    with pytest.raises(hub.HubError, match=r"--model org/tiny at revision v9: neither a local path nor in the "
                                           r"Hugging Face cache .* run `hf download org/tiny --revision v9`"):
        hub.model_path(EngineConfig(model=REPO, revision="v9"))


def test_the_cache_is_download_dir_else_hf_hub_cache_else_hf_home(offline, monkeypatch, tmp_path):
    cache = os.path.join(offline, "hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty home: only the other two can find the model
    assert hub.model_path(EngineConfig(model=REPO, download_dir=cache)).startswith(cache + os.sep)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    assert hub.model_path(EngineConfig(model=REPO)).startswith(cache + os.sep)
    with pytest.raises(hub.HubError, match="neither a local path nor in the Hugging Face cache"):
        hub.model_path(EngineConfig(model=REPO, download_dir=str(tmp_path)))


def test_a_snapshot_without_weights_offline_names_what_it_lacks(tmp_path, monkeypatch, tiny_model_dir):
    """What `hf download org/tiny config.json tokenizer.json` leaves: config and tokenizer, no weights."""
    with FakeHub({REPO: {"main": (MAIN, folder_files(tiny_model_dir))}}) as fake:
        snapshot_download(REPO, cache_dir=str(tmp_path), endpoint=fake.url, allow_patterns=["*.json"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(hub.HubError, match=r"--model org/tiny: the cached snapshot has no \*.safetensors weights "
                                           r".* run `hf download org/tiny --cache-dir "):
        hub.model_path(EngineConfig(model=REPO, download_dir=str(tmp_path)))
    assert hub.resolve_config_dir(REPO, download_dir=str(tmp_path)).endswith(MAIN)  # all the plan needs


def test_a_local_path_wins_over_a_hub_id(offline, tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.chdir(tmp_path)
    os.makedirs("org")
    os.symlink(tiny_model_dir, os.path.join("org", "tiny"))
    assert hub.model_path(EngineConfig(model=REPO)) == REPO
    assert source_for(EngineConfig(model=REPO)).name == "tiny"  # the folder's name, as for any local path


def test_a_hub_id_is_served_under_its_id_with_the_tokenizer_of_its_snapshot(offline):
    source = source_for(EngineConfig(model=REPO, tokenizer=REPO, revision="v2"))
    assert source.name == REPO
    assert source.path == os.path.join(offline, "hub", "models--org--tiny", "snapshots", V2)
    assert source.tokenizer.name_or_path == source.path


def test_a_tokenizer_hub_id_beside_a_local_model(offline, tiny_model_dir):
    source = source_for(EngineConfig(model=tiny_model_dir, tokenizer=REPO))
    assert source.tokenizer.name_or_path == os.path.join(offline, "hub", "models--org--tiny", "snapshots", MAIN)


def test_a_download_fetches_config_tokenizer_and_the_indexed_safetensors_only(tmp_path, monkeypatch, tiny_model_dir):
    """A sharded checkpoint: the index's shards, not a consolidated copy beside them, nor .bin weights,
    a README or a subfolder's files."""
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}
    files = folder_files(tiny_model_dir)
    files = {**{k: v for k, v in files.items() if k != "model.safetensors"},
             "model-00001-of-00001.safetensors": files["model.safetensors"],
             "model.safetensors.index.json": json.dumps(index).encode(),
             "consolidated.safetensors": b"never fetched", "pytorch_model.bin": b"never fetched",
             "README.md": b"never fetched", "onnx/model.onnx": b"never fetched", "onnx/config.json": b"{}"}
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with FakeHub({REPO: {"main": (MAIN, files)}}) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        folder = hub.model_path(EngineConfig(model=REPO))
    assert sorted(fake.fetched) == ["chat_template.jinja", "config.json", "model-00001-of-00001.safetensors",
                                    "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"]
    assert folder == os.path.join(str(tmp_path), "hub", "models--org--tiny", "snapshots", MAIN)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # now cached: found without the network
    assert hub.model_path(EngineConfig(model=REPO)) == folder


def test_a_repository_without_safetensors_is_refused_after_its_small_files(tmp_path, monkeypatch, tiny_model_dir):
    files = {k: v for k, v in folder_files(tiny_model_dir).items() if k != "model.safetensors"}
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with FakeHub({REPO: {"main": (MAIN, {**files, "pytorch_model.bin": b"pickled"})}}) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        with pytest.raises(hub.HubError, match=r"--model org/tiny: the repository has no \*.safetensors weights: "
                                               r"the engine reads config.json, a tokenizer and \*.safetensors"):
            hub.model_path(EngineConfig(model=REPO))
    assert "pytorch_model.bin" not in fake.fetched


def test_the_sampling_defaults_are_the_generation_config_numbers(offline):
    assert source_for(EngineConfig(model=REPO, revision="v2")).sampling_defaults == SamplingDefaults(
        temperature=0.7, top_p=0.9, top_k=7, min_p=0.05, repetition_penalty=1.3, max_tokens=5)
    assert source_for(EngineConfig(model=REPO, revision="v2", generation_config="vllm")).sampling_defaults \
        == SamplingDefaults()
    folder = hub.model_path(EngineConfig(model=REPO, revision="v2"))
    assert source_for(EngineConfig(model=REPO, generation_config=folder)).sampling_defaults.max_tokens == 5


def _generate(capsys, *argv: str) -> str:
    assert main(["generate", PROMPT, "--device", "cpu", "--kv-cache-memory", "16MiB", "--ignore-eos", "--seed", "3",
                 *argv]) == 0
    return capsys.readouterr().out


def test_generation_config_defaults_reach_a_request_offline(offline, capsys, tiny_model_dir):
    """The file's sampling applies to a request that sets none: the same text as those numbers given
    as flags (five tokens, sampled), and not the greedy 64 tokens of --generation-config vllm."""
    defaults = _generate(capsys, "--model", REPO, "--revision", "v2")
    flags = _generate(capsys, "--model", tiny_model_dir, "--temperature", "0.7", "--top-p", "0.9", "--top-k", "7",
                      "--min-p", "0.05", "--repetition-penalty", "1.3", "--max-tokens", "5")
    ignored = _generate(capsys, "--model", REPO, "--revision", "v2", "--generation-config", "vllm")
    greedy = _generate(capsys, "--model", tiny_model_dir, "--temperature", "0", "--max-tokens", "64")
    assert defaults == flags
    assert ignored == greedy != defaults
    overridden = _generate(capsys, "--model", REPO, "--revision", "v2", "--temperature", "0", "--max-tokens", "64")
    assert overridden != greedy  # a flag replaces one default; the file's others (top_k, penalty) still apply


@pytest.mark.parametrize("model, gguf_file", [("org/gguf:sub/model-Q8_0.gguf", None),
                                              ("org/gguf", "sub/model-Q8_0.gguf")])
def test_a_gguf_file_of_a_hub_id_is_downloaded_alone(tmp_path, monkeypatch, model, gguf_file):
    files = {"sub/model-Q8_0.gguf": b"GGUF one file", "model-Q4_0.gguf": b"GGUF another", "config.json": b"{}"}
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    with FakeHub({"org/gguf": {"main": (MAIN, files)}}) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        path = hub.model_path(EngineConfig(model=model, gguf_file=gguf_file))
    assert fake.fetched == ["sub/model-Q8_0.gguf"]
    assert path == os.path.join(str(tmp_path), "hub", "models--org--gguf", "snapshots", MAIN, "sub", "model-Q8_0.gguf")
    with open(path, "rb") as f:
        assert f.read() == b"GGUF one file"


@pytest.mark.slow
def test_engine_serve_serves_a_hub_id_under_its_id(hf_home, tiny_model_dir, tmp_path):
    """The server a vLLM user starts with `serve ORG/NAME`: the official client sees the id, and the
    completion is transformers' greedy one for the same weights."""
    import openai
    from transformers import AutoTokenizer

    from tests.server.server_harness import ServerProcess

    server = ServerProcess([REPO, "--num-kv-blocks", "64"], str(tmp_path / "server.log"), env=_env(hf_home))
    try:
        with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60) as client:
            assert [m.id for m in client.models.list().data] == [REPO]
            text = client.completions.create(model=REPO, prompt=PROMPT, max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
    finally:
        assert server.stop() == 0
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    expected = hf_greedy(tiny_model_dir, tokenizer(PROMPT)["input_ids"], 6)
    assert text == tokenizer.decode(expected, skip_special_tokens=True)


def test_the_plan_reads_config_json_alone(offline, tmp_path, monkeypatch, tiny_model_dir):
    """engine plan's --model: the cached snapshot offline; else config.json is the one file downloaded."""
    assert hub.resolve_config_dir(REPO, "v2") == os.path.join(offline, "hub", "models--org--tiny", "snapshots", V2)
    assert hub.resolve_config_dir(tiny_model_dir) == tiny_model_dir
    with pytest.raises(hub.HubError, match="a GGUF file has no config.json"):
        hub.resolve_config_dir("org/tiny:model.gguf")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with FakeHub({REPO: {"main": (MAIN, folder_files(tiny_model_dir))}}) as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        folder = hub.resolve_config_dir(REPO)
    assert fake.fetched == ["config.json"] and os.listdir(folder) == ["config.json"]


def test_engine_plan_reads_a_hub_ids_config_from_the_cache(hf_home, tiny_model_dir):
    """`engine plan` needs only config.json: a cached Hub id plans as its folder does; an uncached one
    offline is one line."""
    def plan(model: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "engine", "plan", "serve", "--model", model, "--gpu", "h100-sxm",
                               "--json"], cwd=ROOT, env=_env(hf_home), capture_output=True, text=True, timeout=120)

    by_id, by_folder, absent = plan(REPO), plan(tiny_model_dir), plan("org/absent")
    assert by_id.returncode == by_folder.returncode == 0, by_id.stderr[-2000:]
    assert json.loads(by_id.stdout)["model"] == json.loads(by_folder.stdout)["model"]
    assert absent.returncode == 2 and len(absent.stderr.strip().splitlines()) == 1 and "org/absent" in absent.stderr


def test_bench_reads_a_hub_ids_dtype_as_its_folders(offline, tiny_model_dir):
    """`engine bench`'s dtype "auto" is the engine's reading of the model's config.json, for a Hub id too."""
    from engine.bench.runner import resolve_dtype

    from engine.runner.model_runner import resolve_dtype as engine_dtype

    assert resolve_dtype("auto", "cpu", REPO) == "float32"
    # What the engine itself runs a bfloat16 checkpoint in on this CPU (bfloat16 where it has native bf16 matmuls).
    assert resolve_dtype("auto", "cpu", BF16_REPO) == str(engine_dtype("auto", torch.device("cpu"), "bfloat16"))[6:]
