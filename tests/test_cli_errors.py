"""A CLI error is one line that names the flag or value and says what to do: a pasted vLLM flag
gets what to use here instead, an unknown flag where the flags are listed, a bad setting no
traceback (each command run as a user runs it: a real process, its exit code and stderr)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv, says", [
    (["serve", "--load-format", "auto"], "engine serve: error: --load-format is a vLLM flag with no counterpart "
                                         "here: weights load from the safetensors or .gguf files --model names"),
    (["serve", "--tokenizer-mode=slow"], "--tokenizer-mode is a vLLM flag"),
    (["generate", "hi", "--lora-modules", "a=b"], "engine generate: error: --lora-modules is a vLLM flag"),
    (["serve", "--no-such-flag"], "engine serve: error: unrecognized arguments: --no-such-flag (`engine serve --help` "
                                  "lists the flags)"),
    (["bench", "serve", "--no-such-flag", "1"], "engine bench serve: error: unrecognized arguments: --no-such-flag 1"),
    (["serve", "--port", "abc"], "engine serve: error: argument --port: invalid int value: 'abc'"),
])
def test_a_refused_flag_is_one_line_saying_what_to_do(argv, says):
    done = run("-m", "engine", *argv)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()] and says in done.stderr, done.stderr
    assert done.stderr.startswith("engine "), done.stderr


def test_the_bubble_tool_says_a_bad_model_in_one_line():
    done = run("-m", "engine.bench.bubble", "--model", os.path.join(ROOT, "no-such-model"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"python -m engine.bench.bubble: error: model path {os.path.join(ROOT, 'no-such-model')!r} does not exist: "
        "pass a folder with config.json and *.safetensors, a .gguf file, a Hub id ORG/NAME, or no model for the "
        "embedded default"]


@pytest.mark.parametrize("argv, says", [
    (["--revision", "v2"], "engine generate: error: revision 'v2' picks a version of a Hub id --model (ORG/NAME), but "
                           "the model is the embedded default: drop --revision"),
    (["--generation-config", "no-such-folder"], "engine generate: error: generation_config 'no-such-folder' is neither "
                                                "auto, vllm, nor a folder holding a generation_config.json"),
    (["--model", "org/name", "--gguf-file", "model.bin"], "gguf_file 'model.bin' must name a .gguf file"),
    (["--swap-space", "-1"], "engine generate: error: swap_space must be None or >= 0 (GiB), got -1.0"),
])
def test_a_bad_hub_or_vllm_setting_is_one_line(argv, says):
    done = run("-m", "engine", "generate", "hi", "--device", "cpu", *argv)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()] and says in done.stderr, done.stderr


def _tiny_folder(tmp_path, tiny_model_dir, **changes) -> str:
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return str(folder)


def test_a_model_that_is_not_served_is_one_line(tmp_path, tiny_model_dir):
    from engine.models.registry import MODEL_REGISTRY

    says = f"model_type 'deepseek_v3' is not supported; the served families are {', '.join(sorted(MODEL_REGISTRY))}"
    done = run("-m", "engine", "generate", "hi", "--device", "cpu", "--model",
               _tiny_folder(tmp_path, tiny_model_dir, model_type="deepseek_v3"))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"engine generate: error: {says}"), done.stderr


@pytest.mark.slow
def test_vllm_deployment_flags_are_accepted_with_one_notice_each(tiny_model_dir):
    done = run("-m", "engine", "generate", "hi", "--device", "cpu", "--kv-cache-memory", "16MiB", "--max-tokens", "2",
               "--model", tiny_model_dir, "--trust-remote-code", "--disable-log-requests", "--disable-log-stats",
               "--swap-space", "4", "--generation-config", "vllm")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("hi")
    notices = {"--trust-remote-code: no checkpoint code is ever run here": 1,
               "--disable-log-requests has no effect: requests are logged only with --log-requests": 1,
               "--disable-log-stats has no effect: there is no periodic stats line": 1,
               "--swap-space has no effect: a preempted request's KV blocks are freed and its tokens recomputed": 1}
    assert {n: done.stderr.count(n) for n in notices} == notices, done.stderr
