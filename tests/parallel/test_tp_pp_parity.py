"""TP 2, PP 2 and TP 2 x PP 2 in real processes (gloo on CPU) give the single process's greedy
tokens, with chunked prefill and preemption in play; every rank holds its share of the weights
and of the KV cache, measured from its own tensors, and that share is what engine.planning
predicts for the layout."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import kernels
from engine.frontend.llm import LLM
from engine.executor.executor import pipeline_bubble
from engine.planning import ModelSpec, kv_bytes_per_token, kv_capacity_tokens
from tests.parallel.helpers import BLOCK_SIZE, ENGINE_ARGS, NUM_BLOCKS, PROMPTS, forked, greedy

FLOAT32 = 4


@dataclass
class Run:
    tp: int
    pp: int
    spec: ModelSpec
    kv_budget: int
    outputs: list
    fork: object
    stats: dict
    reports: list[dict]
    embeddings: list[list[float]]


def kv_budget_for(spec: ModelSpec, tp: int, pp: int) -> int:
    """A per-rank KV budget of NUM_BLOCKS blocks by planning's arithmetic, plus half a block that
    the engine must round away: the parallel engine sizes its cache from bytes, not a count."""
    per_token = kv_bytes_per_token(spec, FLOAT32, tp, pp)
    return per_token * BLOCK_SIZE * NUM_BLOCKS + per_token * BLOCK_SIZE // 2


@pytest.fixture(scope="module", params=[(2, 1), (1, 2), (2, 2)], ids=lambda p: f"tp{p[0]}-pp{p[1]}")
def run(request, gqa_model) -> Run:
    tp, pp = request.param
    spec = ModelSpec.from_hf_config(gqa_model)
    budget = kv_budget_for(spec, tp, pp)
    with LLM(gqa_model, tensor_parallel_size=tp, pipeline_parallel_size=pp, kv_cache_memory=budget,
             **ENGINE_ARGS) as llm:
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        fork = llm.generate(PROMPTS[1], forked(), use_tqdm=False)[0]
        stats, reports = llm.engine.stats(), llm.engine.runner.rank_reports()
        embeddings = llm.embed(PROMPTS[:2], pooling="mean", use_tqdm=False)  # chunked: 32-token budget
        yield Run(tp, pp, spec, budget, [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs], fork,
                  stats, reports, embeddings)


def test_same_greedy_tokens_as_one_process(run, single_process_outputs):
    expected, expected_fork, _ = single_process_outputs
    assert run.outputs == expected
    assert run.stats["num_preemptions"] > 0, "no preemption: the test lost its point"
    assert run.stats["num_chunked_prefills"] > 0, "no chunked prefill: the test lost its point"


def test_fork_and_prompt_logprobs_cross_ranks(run, single_process_outputs):
    _, expected, _ = single_process_outputs
    assert [c.token_ids for c in run.fork.outputs] == [c.token_ids for c in expected.outputs]
    got, want = run.fork.prompt_logprobs, expected.prompt_logprobs
    assert len(got) == len(want) and got[0] is None
    for g, w in zip(got[1:], want[1:]):
        assert g.keys() == w.keys()
        assert all(abs(g[t] - w[t]) < 1e-4 for t in w)


def test_embeddings_cross_ranks(run, gqa_model):
    """Mean pooling sums the final hidden states over prefill chunks on the last stage's sampling
    rank and ships the vector to rank 0: transformers' own states, normalised."""
    import torch
    from transformers import AutoTokenizer

    from tests.engine.hf_oracle import hf_hidden

    tok = AutoTokenizer.from_pretrained(gqa_model)
    for text, got in zip(PROMPTS[:2], run.embeddings):
        want = hf_hidden(gqa_model, tok(text).input_ids).mean(0)
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want / want.norm(), atol=2e-5, rtol=1e-4)


def tied_head_copy_bytes(run) -> int:
    """On the cpu backend a tied LM head is packed for oneDNN beside the embedding, which keeps the
    plain weight: a rank holding both (a single pipeline stage) holds its vocabulary slice twice.
    (Planning counts a GPU's memory, where the head and the embedding are one tensor.)"""
    if kernels.resolve_backend("auto", "cpu") != "cpu" or not run.spec.tie_word_embeddings or run.pp != 1:
        return 0
    return -(-run.spec.vocab_size // run.tp) * run.spec.hidden_size * FLOAT32


def test_each_rank_holds_its_share_as_planned(run):
    reports = run.reports
    assert [r["rank"] for r in reports] == list(range(run.tp * run.pp))
    assert {r["steps"] for r in reports} == {reports[0]["steps"]}, "every rank ran every step"
    per_token = kv_bytes_per_token(run.spec, FLOAT32, run.tp, run.pp)
    blocks = kv_capacity_tokens(run.kv_budget, per_token, BLOCK_SIZE) // BLOCK_SIZE
    assert blocks == NUM_BLOCKS
    for r in reports:
        assert r["num_layers"] == run.spec.num_layers // run.pp
        assert r["num_blocks"] == blocks
        # Only this rank's KV heads of only its stage's layers.
        assert r["kv_cache_bytes"] == per_token * blocks * BLOCK_SIZE
    planned = run.spec.params_per_gpu(run.tp, run.pp) * FLOAT32
    assert max(r["param_bytes"] for r in reports) == planned + tied_head_copy_bytes(run)
    for stage in range(run.pp):  # the TP ranks of a stage hold equal shards
        assert len({r["param_bytes"] for r in reports if r["stage"] == stage}) == 1
    whole = run.spec.params_per_gpu(1, 1) * FLOAT32
    assert all(r["param_bytes"] < whole for r in reports)


def test_pipeline_bubble_is_measured(run):
    if run.pp == 1:
        pytest.skip("no pipeline")
    bubble = pipeline_bubble(run.reports, run.pp)
    last = [r for r in run.reports if r["stage"] == run.pp - 1]
    assert all(r["recv_wait_s"] > 0 for r in last)  # the last stage waited on the first: measured, not assumed
    assert 0.0 <= bubble < 1.0
    print(f"tp{run.tp} pp{run.pp}: pipeline bubble {bubble:.0%} of step time")
