"""The `engine` command line: one vocabulary of flags, and start-up failures that come fast, in
one line on stderr with exit 2, before any weight loads."""

from __future__ import annotations

import dataclasses

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from engine.arg_utils import engine_config_from_args, parse_bytes
from engine.cli import build_parser, main
from engine.config import EngineConfig
from engine.loading.loader import ModelFolderError, check_safetensors_file, resolve_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30


def run_engine(*argv, timeout=120):
    return subprocess.run([sys.executable, "-m", "engine", *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def parse(*argv):
    return build_parser().parse_args(list(argv))


def one_line_error(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"engine {command}: error: "), err
    return lines[0]


# ---------------------------------------------------------------- one vocabulary


def test_vllm_spellings_parse_to_the_engine_config():
    args = parse("serve", "./some-model", "-tp", "2", "-pp", "2", "-dp", "2", "--dtype", "half",
                 "--kv-cache-dtype", "bf16", "--kv-cache-memory", "512MiB", "--max-waiting-requests", "none")
    assert args.model_tag == "./some-model"
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.data_parallel_size) == (2, 2, 2)
    assert (args.dtype, args.kv_cache_dtype) == ("float16", "bfloat16")
    assert args.kv_cache_memory == 512 << 20 and args.max_waiting_requests is None
    old = parse("generate", "hi", "--tp", "2", "--pp", "3", "--dtype", "float")
    assert (old.tensor_parallel_size, old.pipeline_parallel_size, old.dtype) == (2, 3, "float32")


def test_defaults_equal_the_engine_config():
    args = parse("serve")
    config = EngineConfig()
    for name in [f.name for f in dataclasses.fields(EngineConfig)]:
        assert getattr(args, name) == getattr(config, name), name
    assert args.kv_cache_memory is None  # unset: 2 GiB on CPU, the utilization rule on CUDA


def test_dtype_aliases_are_normalized_in_the_config_too():
    config = EngineConfig(dtype="bf16", kv_cache_dtype="half")
    assert (config.dtype, config.kv_cache_dtype) == ("bfloat16", "float16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="int3")


def test_positional_model_and_model_flag(tmp_path):
    assert engine_config_from_args(parse("serve", str(tmp_path))).model == str(tmp_path)
    assert engine_config_from_args(parse("serve", "--model", str(tmp_path))).model == str(tmp_path)
    with pytest.raises(ValueError, match="given twice"):
        engine_config_from_args(parse("serve", str(tmp_path), "--model", str(tmp_path / "other")))


@pytest.mark.parametrize("argv", [
    ["serve", "--kv-cache-mem", "2GiB"],        # prefix of --kv-cache-memory: no silent abbreviation
    ["generate", "hi", "--max-tok", "3"],
    ["generate", "hi", "--sampling-seed", "3"],  # one seed: --seed
    ["generate", "hi", "--max-waiting-requests", "3"],  # serving-only flags are not generate's
])
def test_unknown_or_abbreviated_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--log-level", "debug", "serve"],
    ["serve", "--log-level", "DEBUG"],
    ["serve", "--log-level=Debug", "--port", "1"],
])
def test_log_level_before_or_after_the_command_in_any_case(argv):
    assert parse(*argv).log_level == "DEBUG"
    assert parse("serve").log_level == "INFO"


def test_serve_ops_flags():
    args = parse("serve", "--allowed-origins", "https://a.example,https://b.example",
                 "--allowed-origins", '["https://c.example"]', "--protect-metrics", "--uvicorn-log-level", "WARNING")
    assert args.allowed_origins == ["https://a.example", "https://b.example", "https://c.example"]
    assert args.protect_metrics and args.uvicorn_log_level == "warning"
    closed = parse("serve")
    assert closed.allowed_origins is None and not closed.protect_metrics and closed.api_key is None


def test_api_key_from_env_prefers_pagewise(monkeypatch):
    from server.cli import api_key_from_env

    monkeypatch.delenv("PAGEWISE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert api_key_from_env() is None
    monkeypatch.setenv("OPENAI_API_KEY", "openai")
    assert api_key_from_env() == "openai"
    monkeypatch.setenv("PAGEWISE_API_KEY", "pagewise")
    assert api_key_from_env() == "pagewise"


def test_parse_bytes_units():
    assert parse_bytes("2GiB") == 2 * GiB and parse_bytes("1.5gb") == 1_500_000_000 and parse_bytes("4096") == 4096


def test_version_and_module_forms():
    import engine

    done = run_engine("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"pagewise {engine.__version__}"
    for module in ("engine", "server"):  # `python -m server` is a thin alias of `python -m engine`
        done = subprocess.run([sys.executable, "-m", module, "serve", "--help"], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
        assert done.returncode == 0 and "--tensor-parallel-size" in done.stdout, done.stderr


def test_plan_stays_light_with_a_log_level_before_it():
    code = ("import sys; from engine.cli import main; "
            "rc = main(['--log-level', 'debug', 'plan', 'serve', '--model', 'gpt2', '--gpu-memory-gib', '24']); "
            "assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------- fail fast


def test_port_in_use_fails_before_loading(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        # No --model: the default model would take a while to load, so a fast exit proves the order.
        done = run_engine("serve", "--port", str(port), timeout=60)
        elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stderr
    line = one_line_error(done.stderr, "serve")
    assert f"port {port} is in use" in line and "--port" in line
    assert elapsed < 30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from tests.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-cli"))


def _copy(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def bad_folders(tiny: str, tmp_path) -> dict[str, tuple[str, list[str]]]:
    """Each bad folder and what its one-line error must say."""
    empty = tmp_path / "empty"
    empty.mkdir()
    bin_only = _copy(tiny, tmp_path / "bin-only")
    os.remove(os.path.join(bin_only, "model.safetensors"))
    with open(os.path.join(bin_only, "pytorch_model.bin"), "wb") as f:
        f.write(b"not loaded: only its name matters")
    truncated = _copy(tiny, tmp_path / "truncated")
    weights = os.path.join(truncated, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) // 2)
    return {
        "empty": (str(empty), ["has no config.json"]),
        "bin-only": (bin_only, ["pytorch_model.bin", "save_pretrained", "safe_serialization=True"]),
        "truncated": (truncated, [weights, "truncated"]),
    }


@pytest.mark.parametrize("kind", ["empty", "bin-only", "truncated"])
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_bad_model_folder_is_one_line_and_exit_2(tiny, tmp_path, kind, command, capsys):
    folder, words = bad_folders(tiny, tmp_path)[kind]
    argv = ["serve", folder, "--port", "0"] if command == "serve" else ["generate", "hi", "--model", folder]
    assert main(argv) == 2
    line = one_line_error(capsys.readouterr().err, command)
    for word in words:
        assert word in line, line


@pytest.mark.parametrize("host, key, warned", [("0.0.0.0", None, True), ("0.0.0.0", "k", False),
                                               ("127.0.0.1", None, False)])
def test_open_host_without_api_key_warns(tmp_path, monkeypatch, caplog, host, key, warned):
    monkeypatch.delenv("PAGEWISE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    if key:
        monkeypatch.setenv("PAGEWISE_API_KEY", key)
    assert main(["serve", str(tmp_path), "--host", host, "--port", "0"]) == 2  # no config.json: stops after
    assert any("with no API key" in r.getMessage() for r in caplog.records) == warned


def test_truncated_model_serve_subprocess_fails_fast(tiny, tmp_path):
    folder, words = bad_folders(tiny, tmp_path)["truncated"]
    done = run_engine("serve", folder, "--port", "0")
    assert done.returncode == 2, done.stderr
    assert all(w in one_line_error(done.stderr, "serve") for w in words)


def _safetensors(path, tensors: dict) -> str:
    import torch
    from safetensors.torch import save_file

    save_file({k: torch.zeros(v) for k, v in tensors.items()}, str(path))
    return str(path)


def test_safetensors_header_checks(tmp_path):
    good = _safetensors(tmp_path / "good.safetensors", {"a": 64, "b": 32})
    check_safetensors_file(good)
    size = os.path.getsize(good)
    header_len = int.from_bytes(open(good, "rb").read(8), "little")
    short_header = tmp_path / "short-header.safetensors"
    short_header.write_bytes(open(good, "rb").read(8 + header_len // 2))
    with pytest.raises(ModelFolderError, match=f"{short_header}: truncated: the header says it is {header_len}"):
        check_safetensors_file(str(short_header))
    short_data = tmp_path / "short-data.safetensors"
    short_data.write_bytes(open(good, "rb").read(size - 4))
    with pytest.raises(ModelFolderError, match=f"tensor data ends at byte {size} but the file is {size - 4} bytes"):
        check_safetensors_file(str(short_data))
    tiny_file = tmp_path / "tiny.safetensors"
    tiny_file.write_bytes(b"abc")
    with pytest.raises(ModelFolderError, match="too short"):
        check_safetensors_file(str(tiny_file))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes((4).to_bytes(8, "little") + b"\xff\xfe{]")
    with pytest.raises(ModelFolderError, match="not JSON"):
        check_safetensors_file(str(garbage))


def test_sharded_index_names_a_missing_shard(tiny, tmp_path):
    folder = _copy(tiny, tmp_path / "sharded")
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}, f)
    with pytest.raises(ModelFolderError, match="lacks 1 of the 2 shards .* model-00002-of-00002.safetensors"):
        resolve_model(folder)


def test_nested_folder_hint(tiny, tmp_path):
    _copy(tiny, tmp_path / "outer" / "snapshot")
    with pytest.raises(ModelFolderError, match="did you mean .*snapshot"):
        resolve_model(str(tmp_path / "outer"))


# ---------------------------------------------------------------- chat template


def test_chat_template_text_or_file(tiny, tmp_path):
    text = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert resolve_model(tiny, chat_template=text).tokenizer.chat_template == text
    file = tmp_path / "template.jinja"
    file.write_text(text)
    config = EngineConfig(model=tiny, chat_template=str(file))
    assert resolve_model(tiny, chat_template=config.chat_template).tokenizer.chat_template == text
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        EngineConfig(chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="Jinja syntax error"):
        resolve_model(tiny, chat_template="{% for m in messages %}")


# ---------------------------------------------------------------- generate


@pytest.mark.parametrize("argv, words", [
    # Each must name what to change, where a traceback (or, the first, negative TPOTs) would otherwise come out.
    (["bench", "latency", "--batch-size", "1", "--input-len", "510", "--output-len", "8", "--num-iters", "1",
      "--num-iters-warmup", "0", "--max-model-len", "512"], ["--input-len / --output-len", "max_model_len (512)"]),
    (["bench", "latency", "--batch-size", "1", "--input-len", "4", "--output-len", "2", "--output-json", "."],
     ["--output-json", "is a directory"]),
    pytest.param(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "2", "--random-input-len",
                  "8", "--random-output-len", "4"], ["warm-up request failed", "--base-url"],  # no server there
                 marks=pytest.mark.device_auto),  # a client: it takes no --device, and builds no engine
    (["generate", "hi", "--tokenizer", "/no/such/tokenizer"], ["tokenizer path", "does not exist"]),
    (["generate", "hi", "--tokenizer", "EMPTY"], ["no tokenizer could be loaded", "tokenizer.json"]),
    (["generate", "hi", "--seed", "99999999999999999999999"], ["seed must be a 64-bit integer"]),
    (["generate", "hi", "--distributed-timeout-s", "inf"], ["distributed_timeout_s must be a finite number"]),
])
def test_bad_flags_are_one_line_and_exit_2(tiny, tmp_path, argv, words, capsys):
    argv = [str(tmp_path) if a == "EMPTY" else a for a in argv]
    command = argv[0]
    try:
        code = main([*argv, "--model", tiny, *([] if argv[:2] == ["bench", "serve"] else ["--device", "cpu"])])
    except SystemExit as e:  # the checks before any work exit at once, as argparse does
        code = e.code
    assert code == 2
    err = "\n".join(line for line in capsys.readouterr().err.splitlines() if not line.startswith("note: "))
    line = one_line_error(err, command)  # (bench's note on a busy machine aside)
    for word in words:
        assert word in line, line


def _generate(capsys, tiny, *argv) -> str:
    assert main(["generate", "Hello", "--model", tiny, "--device", "cpu", "--kv-cache-memory", "16MiB",
                 "--max-tokens", "6", "--ignore-eos", *argv]) == 0
    return capsys.readouterr().out


def test_generate_sampling_flags(tiny, capsys):
    greedy = _generate(capsys, tiny)
    assert greedy.startswith("Hello") and greedy.endswith("\n")
    assert _generate(capsys, tiny, "--n", "2") == greedy * 2  # each output printed after its prompt
    sampled = ["--n", "2", "--temperature", "1.0", "--min-p", "0.01", "--seed", "7"]
    assert _generate(capsys, tiny, *sampled) == _generate(capsys, tiny, *sampled)  # --seed: output repeats
    completion = greedy[len("Hello"):-1]
    stop = completion[2:4]
    if stop.strip():
        cut = _generate(capsys, tiny, "--stop", "no such text", "--stop", stop)
        assert cut == "Hello" + completion[: completion.index(stop)] + "\n"


def test_serve_exits_1_when_the_engine_dies(tiny):
    """The engine loop dies serving a request: the server stops itself and `engine serve` exits
    with status 1 (not by its own SIGTERM), so a supervisor sees the failure and restarts it."""
    import re

    import httpx

    code = ("import sys; from engine.core.engine_core import EngineCore\n"
            "def step(self): raise RuntimeError('injected failure')\n"
            "EngineCore.step = step\n"
            "from engine.cli import main\n"
            f"sys.exit(main(['serve', {tiny!r}, '--port', '0', '--device', 'cpu', '--kv-cache-memory', '16MiB', "
            "'--served-model-name', 'tiny']))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        url, log = None, []
        while url is None:
            line = proc.stdout.readline()
            assert line, "".join(log)
            log.append(line)
            if m := re.search(r"pagewise listening on (http://\S+)", line):
                url = m.group(1)
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2},
                       timeout=60)
        assert r.status_code >= 500
        assert proc.wait(60) == 1, "".join(log) + proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


def test_chat_template_reaches_the_engine(tiny, capsys):
    # Needs the front end to open the model with resolve_model(..., chat_template=config.chat_template).
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    assert main(["generate", "Hello", "--chat", "--model", tiny, "--device", "cpu", "--kv-cache-memory", "16MiB",
                 "--max-tokens", "1", "--chat-template", template]) == 0
    from engine import LLM

    with LLM(tiny, device="cpu", kv_cache_memory=16 << 20, chat_template=template) as llm:
        assert llm.tokenizer.chat_template == template


def test_auto_tool_choice_without_a_parser_fails_fast(tiny, capsys):
    assert main(["serve", tiny, "--port", "0", "--enable-auto-tool-choice"]) == 2
    line = one_line_error(capsys.readouterr().err, "serve")
    assert "--tool-call-parser" in line
