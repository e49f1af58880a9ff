"""The engine sizes its KV cache with engine/planning: its capacity at startup equals `engine plan serve`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine import LLM

GiB = 1 << 30


@pytest.mark.parametrize("dtype,budget_gib,block_size", [("float32", 0.01, 16), ("bfloat16", 0.003, 32)])
def test_engine_capacity_equals_plan_serve(tiny_models, dtype, budget_gib, block_size):
    path = tiny_models("qwen3")  # explicit head_dim, GQA: the per-token formula has no shortcut
    llm = LLM(path, device="cpu", dtype=dtype, kv_cache_memory=int(budget_gib * GiB), block_size=block_size,
              max_model_len=256)
    engine_tokens = llm.engine.runner.num_blocks * block_size
    plan = subprocess.run(
        [sys.executable, "-m", "engine.cli", "plan", "serve", "--model", path, "--dtype", dtype,
         "--kv-cache-memory-gib", str(budget_gib), "--block-size", str(block_size), "--max-model-len", "256", "--json"],
        capture_output=True, text=True, check=True)
    predicted = json.loads(plan.stdout)
    assert engine_tokens == predicted["kv_capacity_tokens"] > 0
    # And the engine's KV tensors really hold that many bytes: 2 (K, V) x layers x blocks.
    real = sum(t.numel() * t.element_size() for t in llm.engine.runner.kv_caches)
    assert real == predicted["kv_bytes_per_token"] * engine_tokens
