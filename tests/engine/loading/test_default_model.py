"""The embedded default model (SmolLM2-135M-Instruct) knows the capital of France."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_llm():
    return LLM(device="cpu", kv_cache_memory=256 << 20)


def test_generate_paris(default_llm):
    out = default_llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=16),
                               use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_chat_paris(default_llm):
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_engine_generate_cli_paris():
    run = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "The capital of France is",
                          "--device", "cpu", "--max-tokens", "16", "--kv-cache-memory", "256MiB"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Paris" in run.stdout
