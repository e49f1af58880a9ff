"""`engine bench` end to end on the tiny model: the JSON it writes must be self-consistent."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.slow


def bench(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-m", "engine.bench.cli", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def ordered(d: dict) -> bool:
    return d["p50_ms"] <= d["p90_ms"] <= d["p99_ms"] and d["median_ms"] == pytest.approx(d["p50_ms"])


def test_throughput_compare_engine_and_hf(tiny_model_dir, tmp_path):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    proc = bench("throughput", "--model", tiny_model_dir, "--device", "cpu", "--compare", "engine,hf",
                 "--num-prompts", "6", "--input-len", "12", "--output-len", "5", "--range-ratio", "0.5",
                 "--num-threads", "2", "--max-model-len", "128", "--hf-batch-size", "4", "--output-json", str(out),
                 "--plot", str(png))
    report = json.loads(out.read_text())
    assert "| backend |" in proc.stdout and png.stat().st_size > 0
    assert report["settings"]["num_prompts"] == 6 and report["num_requests"] == 6
    assert [r["backend"] for r in report["results"]] == ["engine", "hf"]
    for r in report["results"]:
        m = r["metrics"]
        assert r["token_count_ok"] and not r["token_count_mismatches"]
        assert m["total_output_tokens"] == r["expected_output_tokens"]  # EOS ignored: exactly what was asked
        assert m["num_requests"] == 6 and r["threads"] == 2
        assert m["requests_per_s"] == pytest.approx(6 / m["wall_s"])
        assert m["output_tokens_per_s"] == pytest.approx(m["total_output_tokens"] / m["wall_s"])
        assert m["total_tokens_per_s"] == pytest.approx(
            (m["total_input_tokens"] + m["total_output_tokens"]) / m["wall_s"])
        assert r["startup_s"] >= r["load_s"] > 0
    engine, hf = report["results"]
    assert engine["metrics"]["total_input_tokens"] == hf["metrics"]["total_input_tokens"]  # same prompts


def test_latency_engine(tiny_model_dir, tmp_path):
    out = tmp_path / "l.json"
    bench("latency", "--model", tiny_model_dir, "--device", "cpu", "--batch-size", "2", "--input-len", "8",
          "--output-len", "4",
          "--num-iters", "3", "--num-iters-warmup", "1", "--max-model-len", "128", "--output-json", str(out),
          "--disable-tqdm")
    report = json.loads(out.read_text())
    (r,) = report["results"]
    assert r["token_count_ok"] and len(r["latencies_s"]) == 3 and len(r["ttfts_s"]) == 3
    assert report["num_requests"] == r["num_requests"] == 3 * 2  # measured batches x batch size, no warm-up
    for key in ("e2e", "ttft", "tpot"):
        assert ordered(r[key])
    assert r["e2e"]["mean_ms"] > r["tpot"]["mean_ms"] > 0


def test_serve_launch_engine(tiny_model_dir, tmp_path):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    n, out_len = 8, 6
    proc = bench("serve", "--launch", "engine", "--model", tiny_model_dir, "--device", "cpu", "--num-prompts", str(n),
                 "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", str(out_len),
                 "--max-concurrency", "1,4", "--request-rate", "50", "--goodput", "ttft:60000", "tpot:60000",
                 "--max-model-len", "128", "--launch-timeout", "180", "--backend", "openai",
                 "--output-json", str(out), "--plot", str(png), "--save-result", "--result-dir", str(tmp_path / "res"))
    assert "Serving Benchmark Result" in proc.stdout and "| server |" in proc.stdout and png.stat().st_size > 0
    assert "--max-model-len 128" in proc.stdout  # the engine flag reached the launched server
    assert f"sent {n}, in flight 0, done {n}, " in proc.stderr and " tok/s" in proc.stderr  # the live line, at the end
    (saved,) = (tmp_path / "res").iterdir()
    assert saved.name.startswith("engine-50.0qps-concurrency1_4-") and saved.suffix == ".json"
    assert json.loads(saved.read_text()) == json.loads(out.read_text())
    report = json.loads(out.read_text())
    assert [(r["server"], r["max_concurrency"]) for r in report["runs"]] == [("engine", 1), ("engine", 4)]
    assert report["servers"]["engine"]["startup_s"] > 0
    for r in report["runs"]:
        check_serve_run(r, n, out_len)


def check_serve_run(r: dict, n: int, out_len: int) -> None:
    m = r["metrics"]
    assert (m["completed"], m["failed"]) == (n, 0)
    assert m["total_output_tokens"] == n * out_len  # counted from usage; ignore_eos keeps lengths exact
    assert m["total_input_tokens"] == n * 16
    assert m["request_throughput"] == pytest.approx(n / m["duration_s"])
    assert m["output_throughput"] == pytest.approx(n * out_len / m["duration_s"])
    assert m["total_token_throughput"] == pytest.approx((n * 16 + n * out_len) / m["duration_s"])
    assert m["good_requests"] == n and m["request_goodput"] == pytest.approx(m["request_throughput"])
    for key in ("ttft", "tpot", "itl", "e2el"):
        assert ordered(m[key]), (key, m[key])
    assert m["ttft"]["mean_ms"] <= m["e2el"]["mean_ms"]
    # at most one gap per token (a server may put several tokens in one chunk)
    assert 0 < len(r["samples"]["itl"]) <= n * (out_len - 1)


VLLM_PYTHON = os.environ.get("PAGEWISE_VLLM_PYTHON")  # e.g. /work/venv-vllm/bin/python


@pytest.mark.skipif(not VLLM_PYTHON, reason="set PAGEWISE_VLLM_PYTHON to an interpreter with vLLM installed")
def test_throughput_compare_with_vllm(tmp_path):
    """Opt-in (vLLM's start-up compiles for a minute or more): the same prompts through vLLM."""
    from tests.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny64", head_dim=64)  # vLLM-CPU attention needs head_dim >= 32
    out = tmp_path / "v.json"
    bench("throughput", "--model", model, "--compare", "engine,vllm", "--vllm-python", VLLM_PYTHON,
          "--num-prompts", "4", "--input-len", "12", "--output-len", "5", "--max-model-len", "128",
          "--output-json", str(out), timeout=900)
    engine, vllm = json.loads(out.read_text())["results"]
    assert vllm["token_count_ok"] and vllm["info"]["vllm"]
    assert vllm["metrics"]["total_output_tokens"] == engine["metrics"]["total_output_tokens"] == 20
    assert vllm["info"]["vllm_env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
