"""Mixture of experts across processes (gloo on CPU): experts sliced over TP ranks (the default),
whole experts per rank (--enable-expert-parallel), and replicas of an expert-parallel engine, each
giving one process's greedy tokens, which are transformers' own."""

from __future__ import annotations

import pytest

from engine.frontend.llm import LLM
from tests.engine.hf_oracle import hf_greedy
from tests.parallel.helpers import ENGINE_ARGS, MAX_TOKENS, NUM_BLOCKS, PROMPTS, greedy
from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    """Qwen2-MoE: 8 experts, top-2, a gated shared expert, a dense layer before and after the
    sparse one; 2 KV heads, so TP 2 splits attention too."""
    return build_tiny_model(tmp_path_factory.mktemp("qwen2-moe"), model_type="qwen2_moe", num_attention_heads=4,
                            num_key_value_heads=2, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=20, intermediate_size=52, shared_expert_intermediate_size=44,
                            decoder_sparse_step=2, norm_topk_prob=False)


@pytest.fixture(scope="module")
def expected(moe_model):
    with LLM(moe_model, num_kv_blocks=NUM_BLOCKS, **ENGINE_ARGS) as llm:
        outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
        tokenizer = llm.engine.tokenizer
    for prompt, out in zip(PROMPTS[:3], outs):  # the single process is itself transformers' greedy
        assert out == hf_greedy(moe_model, tokenizer(prompt)["input_ids"], MAX_TOKENS)
    return outs


@pytest.mark.parametrize("sizes", [dict(tensor_parallel_size=2),
                                   dict(tensor_parallel_size=2, enable_expert_parallel=True),
                                   dict(tensor_parallel_size=2, enable_expert_parallel=True, data_parallel_size=2)],
                         ids=["tp2-sliced-experts", "tp2-expert-parallel", "dp2-tp2-expert-parallel"])
def test_same_greedy_tokens_as_one_process(moe_model, expected, sizes):
    with LLM(moe_model, num_kv_blocks=NUM_BLOCKS, **sizes, **ENGINE_ARGS) as llm:
        outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        stats = llm.engine.stats()
    assert [o.outputs[0].token_ids for o in outs] == expected
    if "data_parallel_size" not in sizes:
        assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0, "the test lost its point"
