"""Triton against the torch reference backend at batch 64 x 4k context, where the decode attention
splits each sequence's keys (split-KV) and merges the parts: the same greedy tokens and top-20
logprobs (the logits up to a constant) in float32."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BATCH, CONTEXT, BLOCK = 64, 4096, 16
LOGPROB_TOL = 2e-3  # float32 both ways; only the order of the sums differs


def test_decode_splits_kv_at_this_shape():
    """The case below must take the split path on this GPU, or it would test the other one."""
    from kernels import triton_ops

    heads, head_dim, blocks = 4, 16, -(-CONTEXT // BLOCK)
    query = torch.empty(BATCH, heads, head_dim, device="cuda")
    k_cache = torch.empty(BATCH * blocks, BLOCK, 1, head_dim, device="cuda")
    tables = torch.zeros(BATCH, blocks, dtype=torch.int32, device="cuda")
    _, splits = triton_ops.launch_plan(query, k_cache, tables, BATCH)
    assert splits > 1


def test_triton_matches_torch_backend_at_batch_64_context_4k(gpu_tiny_models):
    # One KV head: 64 sequences make 64 programs, fewer than a big GPU's SMs, so decode splits.
    path = gpu_tiny_models(f"llama:num_key_value_heads=1,max_position_embeddings={2 * CONTEXT}")
    rng = random.Random(0)
    # Ragged lengths just under 4k: splits end mid-block and differ between sequences.
    prompts = [[rng.randrange(3, 500) for _ in range(CONTEXT - (7 * i) % 97)] for i in range(BATCH)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=20)
    results = {}
    for backend in ("triton", "torch"):
        with LLM(path, device="cuda", dtype="float32", attention_backend=backend, max_num_seqs=BATCH,
                 max_num_batched_tokens=16384, max_model_len=CONTEXT + 16,
                 num_kv_blocks=BATCH * -(-(CONTEXT + 16) // BLOCK) + 8, enable_prefix_caching=False) as llm:
            results[backend] = llm.generate(prompts, params, use_tqdm=False)
    worst = 0.0
    for tri, ref in zip(results["triton"], results["torch"]):
        tri, ref = tri.outputs[0], ref.outputs[0]
        assert tri.token_ids == ref.token_ids
        for a, b in zip(tri.logprobs, ref.logprobs):
            assert a.keys() == b.keys()
            worst = max(worst, max(abs(a[t] - b[t]) for t in a))
    assert worst < LOGPROB_TOL, worst
