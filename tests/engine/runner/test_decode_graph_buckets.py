"""CUDA-graph decode on every device (engine/runner/cuda_graphs.py): the captured sizes, the padding
decision, and the padded decode forward a graph replays, run eagerly on CPU (emulate=True) over
the same persistent buffers: greedy tokens must match transformers token for token while decode
batches run padded up to a captured size. Plus the knobs: enforce_eager / cuda_graph_sizes /
gpu_memory_utilization / kv_cache_memory at the edge."""

from __future__ import annotations

import logging
import os
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.arg_utils import ArgumentParser, add_engine_args, engine_config_from_args
from engine.config import CPU_KV_CACHE_MEMORY, EngineConfig
from engine.runner.cuda_graphs import DecodeGraphs, capture_sizes
from tests.engine.hf_oracle import hf_greedy

if not torch.cuda.is_available():
    # The triton case runs its kernels under Triton's interpreter, as tests/kernels does; the choice
    # is read when kernels/triton_*.py are first imported (the engine imports them lazily).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def test_capture_sizes_follow_vllms_pattern():
    assert capture_sizes(None, 4) == [1, 2, 4]
    assert capture_sizes(None, 40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(None, 256)[-3:] == [240, 248, 256] and len(capture_sizes(None, 256)) == 35
    assert capture_sizes([20], 256) == [1, 2, 4, 8, 16]  # one value: the pattern up to it
    assert capture_sizes([3, 1, 64, 3], 256) == [1, 3, 64]  # several: the sizes themselves


def test_sizes_above_max_num_seqs_are_clipped_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.runner.cuda_graphs"):
        assert capture_sizes([512], 16) == [1, 2, 4, 8, 16]
        assert capture_sizes([2, 100, 300], 64) == [2, 64]
    assert len([r for r in caplog.records if "max_num_seqs" in r.getMessage()]) == 2


def test_padded_size_is_the_smallest_captured_size_that_holds_the_batch():
    graphs = DecodeGraphs([1, 2, 4, 8, 16], prepare=None, forward=None, emulate=True)
    assert [graphs.padded_size(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, None]
    # Nothing captured (CPU, enforce_eager, capture failed): every step is eager.
    assert DecodeGraphs([1, 2, 4], prepare=None, forward=None).padded_size(1) is None


@pytest.mark.parametrize("backend", ["cpu", "torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_padded_decode_matches_transformers(backend, tiny_models):
    path = tiny_models("llama")
    # 8 sequences at most, 30 blocks for 10 prompts: decode batches of every size from 1 to 8
    # (so 3, 5, 6, 7 run padded), preemptions and chunked prefills in between (eager). Triton's
    # interpreter is slow per kernel program, so its case runs the same schedule at half the lengths
    # and fewer new tokens.
    half = backend == "triton"
    llm = LLM(path, device="cpu", num_kv_blocks=15 if half else 30, block_size=16, max_num_seqs=8,
              max_num_batched_tokens=32 if half else 64, max_model_len=200 if half else 400, seed=0,
              attention_backend=backend)
    runner = llm.engine.runner
    if backend == "triton":
        from kernels import triton_ops

        if not triton_ops.INTERPRETED:
            pytest.skip("kernels.triton_ops is compiled for CUDA: it cannot take this test's CPU tensors")
    assert not runner.graphs.active, "CPU captures nothing"
    graphs = DecodeGraphs([1, 2, 4, 8], runner._stage_dummy_decode, runner._decode_forward, emulate=True)
    runner.graphs = graphs
    padded = []  # (real sequences, the size they ran as)
    prepare = runner._prepare_inputs

    def remember(sched):
        step = prepare(sched)
        if step.graph_size is not None:
            padded.append((step.num_seqs, step.graph_size))
        return step

    runner._prepare_inputs = remember
    rng = random.Random(11)
    lengths = (1, 9, 17, 33, 50, 64, 100, 130, 7, 250)
    prompts = [[rng.randrange(3, llm.engine.vocab_size) for _ in range((n + 1) // 2 if half else n)] for n in lengths]
    new_tokens = 6 if half else 10
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True),
                        use_tqdm=False)
    assert llm.engine.stats()["num_preemptions"] > 0 and llm.engine.stats()["num_chunked_prefills"] > 0
    assert any(size > n for n, size in padded), f"some decode batch must run padded: {padded}"
    assert {size for _, size in padded} <= {1, 2, 4, 8}
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, new_tokens), f"prompt of {len(prompt)} tokens"


def test_enforce_eager_and_graph_sizes_are_accepted_on_cpu(tiny_models):
    """Documented no-ops on CPU: the engine starts, captures nothing and generates the same tokens."""
    path = tiny_models("llama")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = []
    for kwargs in ({}, {"enforce_eager": True}, {"cuda_graph_sizes": [1, 2]}):
        llm = LLM(path, device="cpu", num_kv_blocks=16, max_model_len=128, **kwargs)
        assert not llm.engine.runner.graphs.active
        outs.append(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert outs[0] == outs[1] == outs[2]


def test_flags_reach_the_config():
    parser = ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--enforce-eager", "--cuda-graph-sizes", "1", "2", "8",
                                                        "--kv-cache-memory", "512MiB"]))
    assert config.enforce_eager and config.cuda_graph_sizes == [1, 2, 8] and config.kv_cache_memory == 512 << 20
    default = engine_config_from_args(parser.parse_args([]))
    assert not default.enforce_eager and default.cuda_graph_sizes is None and default.kv_cache_memory is None
    # The API takes the flag's spellings too (it raised a TypeError on "512MiB").
    assert EngineConfig(kv_cache_memory="512MiB").kv_cache_memory == 512 << 20


@pytest.mark.parametrize("bad, name", [({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
                                       ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
                                       ({"cuda_graph_sizes": [0, 8]}, "cuda_graph_sizes"),
                                       ({"cuda_graph_sizes": []}, "cuda_graph_sizes"),
                                       ({"kv_cache_memory": 0}, "kv_cache_memory"),
                                       ({"kv_cache_memory": "lots"}, "kv_cache_memory")])
def test_bad_values_name_their_field(bad, name):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**bad)


def test_kv_cache_memory_is_honoured_and_defaults_to_the_cpu_budget(tiny_models, monkeypatch):
    import engine.runner.kv_sizing

    path = tiny_models("llama")
    small = LLM(path, device="cpu", kv_cache_memory=1 << 20, max_model_len=64).engine.runner
    per_block = small.kv_bytes_per_token() * small.block_size
    assert small.num_blocks == (1 << 20) // per_block
    # Without kv_cache_memory, CPU takes CPU_KV_CACHE_MEMORY (made small here: 2 GiB would be touched).
    assert engine.runner.kv_sizing.CPU_KV_CACHE_MEMORY == CPU_KV_CACHE_MEMORY == 2 << 30
    monkeypatch.setattr(engine.runner.kv_sizing, "CPU_KV_CACHE_MEMORY", 3 << 20)
    assert LLM(path, device="cpu", max_model_len=64).engine.runner.num_blocks == (3 << 20) // per_block
    with pytest.raises(ValueError, match="raise kv_cache_memory"):
        LLM(path, device="cpu", kv_cache_memory=per_block - 1, max_model_len=64)
