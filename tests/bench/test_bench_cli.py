"""`engine bench` flags and the checks before any work: vLLM's names, engine flags, help text,
missing packages, the vLLM interpreter, the API key order, latency's request count."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from engine.bench import runner
from engine.bench.cli import add_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GiB = 1 << 30


@pytest.fixture(scope="module")
def bench() -> argparse.ArgumentParser:
    return add_parser(argparse.ArgumentParser(prog="engine").add_subparsers())


def modes(bench) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("vllm_argv,our_argv", [
    (["--random-input-len", "7", "--random-output-len", "3", "--random-range-ratio", "0.5"],
     ["--input-len", "7", "--output-len", "3", "--range-ratio", "0.5"]),
    (["--metric-percentiles", "90,99"], ["--percentiles", "90,99"]),
    (["--backend", "openai-chat"], ["--endpoint", "chat"]),
    (["--endpoint", "/v1/chat/completions"], ["--endpoint", "chat"]),
    (["--backend", "openai"], ["--endpoint", "completions"]),
    (["--backend", "vllm", "--endpoint", "/v1/completions"], []),
    (["--dataset-name", "random"], []),
])
def test_vllm_serve_names_parse_to_our_settings(bench, vllm_argv, our_argv):
    theirs = vars(bench.parse_args(["serve", *vllm_argv]))
    ours = vars(bench.parse_args(["serve", *our_argv]))
    theirs.pop("dataset_name"), ours.pop("dataset_name")
    assert theirs == ours


def test_vllm_offline_names_and_engine_flags(bench):
    a = bench.parse_args(["throughput", "--hf-max-batch-size", "4", "--dataset-name", "random",
                          "--random-input-len", "9", "--block-size", "32", "--attention-backend", "torch",
                          "--no-enable-prefix-caching", "--gpu-memory-utilization", "0.5",
                          "--tensor-parallel-size", "2", "--kv-cache-memory", "512MiB", "--dtype", "bf16"])
    assert (a.hf_batch_size, a.input_len, a.block_size, a.attention_backend) == (4, 9, 32, "torch")
    assert (a.enable_prefix_caching, a.gpu_memory_utilization, a.tensor_parallel_size) == (False, 0.5, 2)
    assert (a.kv_cache_memory, a.dtype) == (512 << 20, "bfloat16")
    assert bench.parse_args(["throughput", "--hf-batch-size", "4"]).hf_batch_size == 4
    assert bench.parse_args(["latency", "--random-input-len", "5"]).input_len == 5
    default = bench.parse_args(["latency"])
    # No --num-threads: the engine keeps its load-following default, every peer gets all cores.
    from engine.bench.common import peer_threads

    assert default.kv_cache_memory is None and default.num_threads is None
    assert peer_threads(default) == len(os.sched_getaffinity(0))
    serve = bench.parse_args(["serve", "--save-result", "--result-dir", "out", "--max-model-len", "64"])
    assert (serve.save_result, serve.result_dir, serve.max_model_len) == (True, "out", 64)
    for gone in (["--kv-cache-gib", "2"], ["--engine-arg", "block_size=32"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["throughput", *gone])


def test_one_dest_per_setting_and_every_flag_explains_its_default(bench):
    from engine.arg_utils import HelpFormatter

    for name, parser in modes(bench).items():
        formatter = HelpFormatter(prog=name)
        dests: dict[str, list[argparse.Action]] = {}
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            dests.setdefault(action.dest, []).append(action)
            if action.help == argparse.SUPPRESS:
                continue  # internal (set by the --compare parent)
            text = formatter._get_help_string(action)
            assert text and len(text) > 10, (name, action.option_strings)
            switch = isinstance(action, argparse._StoreTrueAction)
            assert switch or "default" in text, (name, action.option_strings, text)
        shared = {d: [a.option_strings for a in acts] for d, acts in dests.items() if len(acts) > 1}
        assert shared == ({"endpoint": [["--backend"], ["--endpoint"]]} if name == "serve" else {}), name


def test_help_is_for_users(bench):
    for parser in (bench, *modes(bench).values()):
        text = parser.format_help()
        assert "add_parser" not in text and "runner.py" not in text and ".py" not in text
    assert "--metric-percentiles" in modes(bench)["serve"].format_help()


def test_child_argv_repeats_settings_once_in_canonical_spelling(bench):
    from engine.bench.compare import child_argv

    args = bench.parse_args(["throughput", "--compare", "engine,hf", "--num-prompts", "3", "--range-ratio", "0.5",
                             "--block-size", "32", "--no-enable-prefix-caching", "--kv-cache-memory", "1GiB",
                             "--hf-batch-size", "4", "--disable-tqdm", "--output-json", "x.json"])
    argv = child_argv(args._parser, args)
    assert argv == ["--block-size", "32", "--kv-cache-memory", str(GiB), "--no-enable-prefix-caching",
                    "--disable-tqdm", "--num-prompts", "3", "--random-range-ratio", "0.5",
                    "--hf-max-batch-size", "4"]
    again = bench.parse_args(["throughput", *argv])
    for key in ("num_prompts", "range_ratio", "block_size", "enable_prefix_caching", "kv_cache_memory",
                "hf_batch_size", "disable_tqdm"):
        assert getattr(again, key) == getattr(args, key), key
    assert again.compare is None and again.output_json is None


def _without(monkeypatch, *modules: str) -> None:
    """Make importlib.util.find_spec report these modules as not installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in modules else real(name, *a))


def _no_work(monkeypatch) -> None:
    def work(*_a, **_k):
        raise AssertionError("work started before the checks failed")

    for name in ("resolve_model", "load_tokenizer", "run_offline"):
        monkeypatch.setattr(runner, name, work)
    monkeypatch.setattr("engine.bench.online.run_serve", work)


@pytest.mark.parametrize("argv,missing,says", [
    (["throughput", "--plot", "t.png"], "matplotlib", "pip install matplotlib"),
    (["latency", "--plot", "l.png"], "matplotlib", 'pip install "pagewise[bench]"'),
    (["serve", "--base-url", "http://127.0.0.1:9"], "httpx", "pip install httpx"),
    (["throughput", "--compare", "engine,vllm"], "vllm", "pip install vllm"),
    (["serve", "--launch", "vllm"], "vllm", "pip install vllm"),
])
def test_missing_optional_package_exits_2_in_one_line_before_any_work(bench, monkeypatch, capsys, argv, missing,
                                                                      says):
    _without(monkeypatch, missing)
    _no_work(monkeypatch)
    args = bench.parse_args(argv)
    with pytest.raises(SystemExit) as exc:
        runner.run(args)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("engine bench: error:") and says in err, err


@pytest.mark.parametrize("argv,says", [
    (["serve"], "--base-url"),
    (["serve", "--base-url", "http://x", "--dataset-name", "sharegpt"], "--dataset-path"),
    (["throughput", "--dataset-path", "/nonexistent.json"], "no such file"),
    (["throughput", "--random-range-ratio", "1.5"], "range-ratio"),
    (["throughput", "--compare", "engine,sglang"], "--compare"),
    (["latency", "--metric-percentiles", "50,100"], "percentiles"),
    (["latency", "--num-iters", "0"], "--num-iters"),
])
def test_settings_that_do_not_fit_exit_2_before_any_work(bench, monkeypatch, capsys, argv, says):
    _no_work(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        runner.run(bench.parse_args(argv))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and says in err, err


def test_engine_settings_are_validated_before_any_work(bench, monkeypatch, capsys, tiny_model_dir):
    monkeypatch.setattr(runner, "load_tokenizer", lambda *_: (_ for _ in ()).throw(AssertionError("work")))
    with pytest.raises(SystemExit) as exc:
        runner.run(bench.parse_args(["throughput", "--model", tiny_model_dir, "--device", "cpu", "--block-size", "7"]))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "block_size" in err and len(err.splitlines()) == 1


def test_missing_vllm_interpreter_exits_2_fast(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "engine.bench.cli", "throughput", "--backend", "vllm",
                           "--vllm-python", "/nonexistent/bin/python"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert time.monotonic() - t0 < 30
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "--vllm-python /nonexistent/bin/python" in err, err


def test_vllm_interpreter_without_vllm_says_what_to_install(capsys):
    from engine.bench.checks import check_vllm_python

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this Python")
    with pytest.raises(SystemExit) as exc:
        check_vllm_python(sys.executable)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert f"{sys.executable} -m pip install vllm" in err and "ModuleNotFoundError" in err


def test_api_key_order(monkeypatch):
    from engine.bench.backends.openai_http import auth_headers, resolve_api_key

    monkeypatch.delenv("PAGEWISE_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert resolve_api_key(None) is None and auth_headers(None) == {}
    monkeypatch.setenv("OPENAI_API_KEY", "openai")
    assert resolve_api_key(None) == "openai"
    monkeypatch.setenv("PAGEWISE_API_KEY", "pagewise")
    assert resolve_api_key(None) == "pagewise"
    assert resolve_api_key("flag") == "flag" and auth_headers("flag") == {"Authorization": "Bearer flag"}


def test_settings_in_reports_hide_the_api_key(bench):
    args = bench.parse_args(["serve", "--api-key", "secret"])
    from engine.bench.common import report_settings

    assert report_settings(args)["api_key"] == "<set>"


class FakeBackend:
    """Generates exactly what is asked for, instantly; counts the batches it ran."""

    batches: list[int] = []

    def __init__(self, args):
        self.args = args

    def load(self) -> None:
        pass

    def generate(self, requests, use_tqdm=False):
        FakeBackend.batches.append(len(requests))
        return [[1] * r.output_len for r in requests]

    def info(self) -> dict:
        return {}


def test_latency_reports_only_measured_batches(monkeypatch):
    from engine.bench import offline
    from engine.bench.datasets import SampleRequest

    monkeypatch.setattr(offline, "get_backend", lambda name: FakeBackend)
    monkeypatch.setattr(offline, "set_threads", lambda n: n)
    FakeBackend.batches = []
    args = SimpleNamespace(backend="engine", num_threads=1, batch_size=3, num_iters=4, num_iters_warmup=2,
                           output_len=5, disable_tqdm=True, percentiles=[50.0, 99.0], bench_mode="latency")
    requests = [SampleRequest([1, 2, 3], 5) for _ in range(2 * (2 + 4) * 3)]
    result = offline.run_latency(args, requests)
    assert result["num_requests"] == 4 * 3 == runner.measured_requests(args, requests)
    assert result["num_iters"] == len(result["latencies_s"]) == len(result["ttfts_s"]) == 4
    # start-up warm-up + (2 warm-up + 4 measured) x (prefill batch + full batch)
    assert FakeBackend.batches == [1] + [3] * 12


def test_launch_commands_carry_the_engine_flags(bench, monkeypatch):
    import torch

    from engine.bench.online import launch_cmd

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = bench.parse_args(["serve", "--launch", "engine,vllm", "--block-size", "32", "--no-enable-prefix-caching",
                             "--kv-cache-memory", "1GiB", "--max-model-len", "256", "--num-threads", "2",
                             "--served-model-name", "m", "--server-arg=--max-logprobs=5"])
    args.model, args.dtype = "/models/x", "float32"
    engine, env = launch_cmd(args, "engine")
    flags = " ".join(engine)
    for part in ("--block-size 32", "--no-enable-prefix-caching", f"--kv-cache-memory {GiB}", "--max-model-len 256",
                 "--num-threads 2", "--dtype float32", "--seed 0", "--served-model-name m", "--model /models/x"):
        assert part in flags, part
    assert engine[-1] == "--max-logprobs=5" and env == {}
    vllm, env = launch_cmd(args, "vllm")
    flags = " ".join(vllm)
    for part in (f"--kv-cache-memory-bytes {GiB}", "--block-size 32", "--no-enable-prefix-caching",
                 "--max-model-len 256", "--dtype float32", "--max-num-seqs 256"):
        assert part in flags, part
    assert "--num-threads" not in flags and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    args.num_threads = None  # the default: no pin for the engine server, all cores for a peer
    assert "--num-threads" not in " ".join(launch_cmd(args, "engine")[0])
    cores = len(os.sched_getaffinity(0))
    assert launch_cmd(args, "vllm")[1]["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{cores - 1}"


def test_save_result_file_name_is_vllms(bench):
    from datetime import datetime

    from engine.bench.online import result_path

    when = datetime(2025, 1, 2, 3, 4, 5)
    args = bench.parse_args(["serve", "--base-url", "http://x", "--backend", "openai-chat", "--request-rate", "4",
                             "--max-concurrency", "8", "--result-dir", "res"])
    args.model, args.concurrency_levels = "/m/SmolLM2", [8]
    assert result_path(args, [{"served_model_name": "org/served"}], when) == \
        os.path.join("res", "openai-chat-4.0qps-concurrency8-served-20250102-030405.json")
    args = bench.parse_args(["serve", "--launch", "engine,vllm", "--label", "mine", "--result-filename", "r.json"])
    args.model, args.concurrency_levels = "/m/SmolLM2", [None]
    assert result_path(args, [], when) == os.path.join("bench-results", "r.json")  # the folder git ignores
    args.result_filename = None
    assert result_path(args, [], when) == os.path.join("bench-results", "mine-infqps-SmolLM2-20250102-030405.json")
