"""Fewer KV heads than TP ranks: each rank keeps a whole copy of the KV head its query heads use,
and planning counts the same. (Its own module: a module-scoped parallel engine elsewhere must
be shut down first, since one process holds one parallel engine at a time.)"""

from __future__ import annotations

import pytest

from engine.frontend.llm import LLM
from engine.planning import ModelSpec, kv_bytes_per_token
from tests.parallel.helpers import BLOCK_SIZE, ENGINE_ARGS, NUM_BLOCKS, PROMPTS, greedy

FLOAT32 = 4


def test_kv_heads_replicated_when_fewer_than_ranks(mqa_model):
    args = dict(num_kv_blocks=NUM_BLOCKS, **ENGINE_ARGS)
    with LLM(mqa_model, **args) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
    with LLM(mqa_model, tensor_parallel_size=2, **args) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
        reports = llm.engine.runner.rank_reports()
        with pytest.raises(RuntimeError, match="already running in this process"):
            LLM(mqa_model, **args)  # layers would read this engine's TP state
    assert got == expected
    spec = ModelSpec.from_hf_config(mqa_model)
    per_token = kv_bytes_per_token(spec, FLOAT32, tp=2)
    assert per_token == kv_bytes_per_token(spec, FLOAT32, tp=1)  # replicated: no saving
    assert [r["kv_cache_bytes"] for r in reports] == [per_token * NUM_BLOCKS * BLOCK_SIZE] * 2
    assert max(r["param_bytes"] for r in reports) == spec.params_per_gpu(2, 1) * FLOAT32
