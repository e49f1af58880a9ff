"""dtype "auto" (engine.runner.model_runner.resolve_dtype): bfloat16 on CUDA; on a CPU, the checkpoint's
16-bit dtype as bfloat16 where the CPU multiplies bf16 natively, float32 otherwise; and `engine
bench` names the same dtype for every backend of a run."""

from __future__ import annotations

import pytest
import torch

from engine.runner import model_runner
from engine.runner.model_runner import resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("native", [True, False])
def test_auto_follows_the_checkpoint_and_the_cpu(monkeypatch, native):
    monkeypatch.setattr(model_runner, "_native_bf16_matmul", lambda: native)
    sixteen = torch.bfloat16 if native else torch.float32
    for stored in (torch.bfloat16, "bfloat16", torch.float16, "float16"):
        assert resolve_dtype("auto", CPU, stored) == sixteen, stored
    for stored in (torch.float32, "float32", None):
        assert resolve_dtype("auto", CPU, stored) == torch.float32, stored
    assert resolve_dtype("auto", CUDA, torch.float32) == torch.bfloat16
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        assert resolve_dtype(name, CPU, torch.bfloat16) == dtype  # a named dtype is taken as named


def test_bench_names_the_engines_choice(monkeypatch, tmp_path):
    from engine.bench.runner import resolve_dtype as bench_dtype
    from engine.loading.default_model import default_gguf_path, default_model_path

    monkeypatch.setattr(model_runner, "_native_bf16_matmul", lambda: True)
    assert bench_dtype("auto", "cpu", default_gguf_path()) == "bfloat16"
    assert bench_dtype("auto", "cpu", default_model_path()) == "float32"
    assert bench_dtype("auto", "cpu", "SmolLM2-135M-Instruct") == "float32"  # a served name: no folder to read
    assert bench_dtype("float16", "cpu", default_gguf_path()) == "float16"
    monkeypatch.setattr(model_runner, "_native_bf16_matmul", lambda: False)
    assert bench_dtype("auto", "cpu", default_gguf_path()) == "float32"


def test_the_default_model_runs_in_the_cpus_choice():
    """The engine with no dtype on the default Q4_1 file: bfloat16 where native bf16 matmuls run."""
    from engine import LLM
    from kernels.cpu_ops import native_bf16_matmul

    llm = LLM(device="cpu", num_kv_blocks=16, max_model_len=128)
    try:
        want = torch.bfloat16 if native_bf16_matmul() else torch.float32
        assert llm.engine.runner.dtype == want and llm.engine.runner.kv_dtype == want
    finally:
        llm.shutdown()
