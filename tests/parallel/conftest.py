"""Tiny models for the parallel tests, built once per test run (float32, peaked logits); the
multi-process tests are marked slow."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.parallel.helpers import engine_processes
from tests.tiny_model import build_tiny_model


# Modules whose every test starts worker or replica processes; elsewhere in this folder, a test
# that asks for `new_processes` does. They are the slow lane (`pytest -m "not slow"` skips them).
_MULTI_PROCESS_MODULES = {"test_tp_pp_parity", "test_failures", "test_data_parallel_offline",
                          "test_data_parallel_server", "test_torchrun", "test_kv_replication",
                          "test_moe_parallel"}
_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(item.path).parent != _HERE:
            continue
        if Path(item.path).stem in _MULTI_PROCESS_MODULES or "new_processes" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def new_processes():
    """The live engine processes below this one that appeared since the test began (other suites'
    run-wide fixtures, a server for one, may be running too): call it to list them."""
    before = set(engine_processes())
    return lambda: sorted(set(engine_processes()) - before)


@pytest.fixture(scope="session")
def gqa_model(tmp_path_factory) -> str:
    """Qwen2 (q/k/v biases, tied embeddings), 4 layers, 4 heads over 2 KV heads: TP 2 splits the
    KV heads, PP 2 gives each stage two layers and the last stage its own copy of the tied head."""
    return build_tiny_model(tmp_path_factory.mktemp("qwen2-gqa"), model_type="qwen2", num_attention_heads=4,
                            num_key_value_heads=2, num_hidden_layers=4, tie_word_embeddings=True)


@pytest.fixture(scope="session")
def mqa_model(tmp_path_factory) -> str:
    """Llama with one KV head: under TP 2 each rank holds a replica of it."""
    return build_tiny_model(tmp_path_factory.mktemp("llama-mqa"), model_type="llama", num_attention_heads=4,
                            num_key_value_heads=1, num_hidden_layers=2)


@pytest.fixture(scope="session")
def single_process_outputs(gqa_model):
    """The reference, one process with the same settings: per prompt the greedy (token ids, text);
    a forked request (n=2, prompt logprobs); and the engine's stats."""
    from engine.frontend.llm import LLM
    from tests.parallel.helpers import ENGINE_ARGS, NUM_BLOCKS, PROMPTS, forked, greedy

    with LLM(gqa_model, num_kv_blocks=NUM_BLOCKS, **ENGINE_ARGS) as llm:
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        fork = llm.generate(PROMPTS[1], forked(), use_tqdm=False)[0]
        return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs], fork, llm.engine.stats()
