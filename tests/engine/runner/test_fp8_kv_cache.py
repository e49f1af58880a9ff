"""kv_cache_dtype="fp8" (e4m3, vLLM's meaning) end to end: the engine's capacity equals the plan's
(1 byte an element: twice the blocks of bfloat16 in the same budget), greedy decoding stays close to
a float32 cache, prefix caching, forks and preemption still work, and bad settings are caught at
the edge."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from kernels import cpu_build

GiB = 1 << 30
BACKENDS = ["torch"] + (["cpu"] if cpu_build.available() is None else [])

if getattr(torch, "float8_e4m3fn", None) is None:
    pytest.skip("this torch has no float8_e4m3fn", allow_module_level=True)


@pytest.mark.parametrize("dtype,kv_name,budget_gib,block_size",
                         [("float32", "fp8", 0.01, 16), ("bfloat16", "fp8_e4m3", 0.003, 32)])
def test_engine_capacity_equals_plan_serve(tiny_models, dtype, kv_name, budget_gib, block_size):
    path = tiny_models("qwen3")  # explicit head_dim, GQA: the per-token formula has no shortcut
    common = dict(device="cpu", dtype=dtype, kv_cache_memory=int(budget_gib * GiB), block_size=block_size,
                  max_model_len=256)
    llm = LLM(path, kv_cache_dtype=kv_name, **common)
    runner = llm.engine.runner
    assert runner.kv_dtype == torch.float8_e4m3fn
    engine_tokens = runner.num_blocks * block_size
    plan = subprocess.run(
        [sys.executable, "-m", "engine.cli", "plan", "serve", "--model", path, "--dtype", dtype,
         "--kv-dtype", kv_name, "--kv-cache-memory", f"{int(budget_gib * GiB)}", "--block-size", str(block_size),
         "--max-model-len", "256", "--json"],
        capture_output=True, text=True, check=True)
    predicted = json.loads(plan.stdout)
    assert engine_tokens == predicted["kv_capacity_tokens"] > 0
    real = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    assert real == predicted["kv_bytes_per_token"] * engine_tokens
    # One byte an element: twice the blocks a bfloat16 cache gets from the same budget (the floor of
    # twice a count is twice its floor, or one more).
    bf16_blocks = LLM(path, kv_cache_dtype="bfloat16", **common).engine.runner.num_blocks
    assert runner.num_blocks in (2 * bf16_blocks, 2 * bf16_blocks + 1)


def _prompts(n_tokens=(5, 17, 40, 3, 64, 30, 12, 8), seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in n_tokens]


def _top1_agreement(llm: LLM, sequences: list[list[int]], scored_from: list[int]) -> tuple[int, int]:
    """Teacher-forced: at each position from scored_from[i] on, is the engine's most likely next
    token the one the sequence has there? (prompt_logprobs=1 puts the top token first.)"""
    outs = llm.generate(sequences, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    same = total = 0
    for seq, start, out in zip(sequences, scored_from, outs):
        for pos in range(start, len(seq)):
            same += next(iter(out.prompt_logprobs[pos])) == seq[pos]
            total += 1
    return same, total


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_agrees_with_a_float32_cache_on_most_positions(tiny_models, backend):
    """Measured on this tiny random Llama (float32 weights), 200 positions, both backends alike:
    fp8 KV picks the float32-KV greedy token at 163 (81.5%), a bfloat16 KV cache at 197 (98.5%):
    e4m3 keeps 3 mantissa bits to bfloat16's 7, and a random model's top two logits are often
    within 0.01. Free-running, the sequences part after a few tokens for the same reason."""
    path = tiny_models("llama")
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    common = dict(device="cpu", attention_backend=backend, num_kv_blocks=128, max_model_len=256)
    exact = LLM(path, kv_cache_dtype="float32", **common)
    sequences = [p + o.outputs[0].token_ids for p, o in zip(prompts, exact.generate(prompts, params, use_tqdm=False))]
    fp8 = LLM(path, kv_cache_dtype="fp8", **common)
    same, total = _top1_agreement(fp8, sequences, [len(p) for p in prompts])
    assert total == 200
    assert same >= 150, f"fp8 KV picked the float32-KV token at {same} of {total} positions"
    # The fp8 engine still decodes: its own greedy run is self-consistent with its prefill scoring.
    own = [p + o.outputs[0].token_ids for p, o in zip(prompts, fp8.generate(prompts, params, use_tqdm=False))]
    same_own, _ = _top1_agreement(fp8, own, [len(p) for p in prompts])
    assert same_own >= 190, f"fp8 decode and fp8 prefill disagree at {200 - same_own} of 200 positions"


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_caching_forks_and_preemption_change_no_token(tiny_models, backend):
    """The same fp8 engine with a roomy cache and none of these, against: a shared prefix served from
    cached blocks, n=2 forks (the partial block copied, copy_blocks), chunked prefill, and a cache
    too small for the batch (preempted requests recompute their fp8 blocks)."""
    path = tiny_models("llama")
    rng = random.Random(1)
    prefix = [rng.randrange(3, 500) for _ in range(70)]  # ends mid-block: forks copy the partial block
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    roomy = LLM(path, device="cpu", attention_backend=backend, kv_cache_dtype="fp8", num_kv_blocks=256,
                max_model_len=256, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]

    tight = LLM(path, device="cpu", attention_backend=backend, kv_cache_dtype="fp8", num_kv_blocks=12, max_num_seqs=8,
                block_size=16, max_num_batched_tokens=48, max_model_len=192)
    first = tight.generate(prompts[:1], params, use_tqdm=False)  # its prefix blocks are then cached
    rest = tight.generate(prompts[1:], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == want
    forked = tight.generate(prompts[:3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=2),
                            use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in forked] == [[w, w] for w in want[:3]]
    stats = tight.engine.stats()
    assert stats["prefix_cache_hits"] > 0, "the test must hit the prefix cache"
    assert stats["num_preemptions"] > 0, "the test must exercise preemption"
    assert stats["num_chunked_prefills"] > 0, "the test must exercise chunked prefill"
    assert stats["num_used_blocks"] == 0


def test_unknown_kv_cache_dtype_names_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of .*'fp8'.*got 'fp4'"):
        EngineConfig(kv_cache_dtype="fp4")
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"  # vLLM's explicit name
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype="fp8")  # the weights stay 16/32-bit: fp8 is a KV cache format here


def test_fp8_where_torch_has_no_float8_names_the_flag(tiny_models, monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")  # as a torch before 2.1
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8.*float8_e4m3fn"):
        LLM(tiny_models("llama"), device="cpu", kv_cache_dtype="fp8", num_kv_blocks=16, max_model_len=128)


def test_cli_takes_the_flag():
    from engine.arg_utils import add_engine_args
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp4"])
