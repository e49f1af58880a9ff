"""The engine with attention_backend="triton" (interpreted on CPU) matches transformers' greedy output."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from tests.engine.hf_oracle import hf_greedy
from tests.tiny_model import build_tiny_model


# Llama, Qwen3 for the q/k norms (the norm kernel on head-strided rows) and Mixtral for the
# grouped-GEMM MoE kernel (8 experts, top-2).
MODELS = {"llama": dict(model_type="llama"), "qwen3": dict(model_type="qwen3"),
          "mixtral": dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, intermediate_size=36)}


@pytest.mark.device_auto  # the Triton kernels compiled on CUDA where there is a GPU, interpreted here
@pytest.mark.slow  # 10-15 s a model under the interpreter
@pytest.mark.parametrize("family", sorted(MODELS))
def test_engine_greedy_parity_with_triton_backend(triton_ops, tmp_path, family):
    path = build_tiny_model(tmp_path / "tiny", num_attention_heads=4, num_key_value_heads=2, **MODELS[family])
    # Small enough for the interpreter; chunked prefill (budget 24) and a prompt ending mid-block.
    # float32 pinned: "auto" is bfloat16 on CUDA, and the expectations are float32 transformers.
    llm = LLM(path, attention_backend="triton", dtype="float32", num_kv_blocks=32, max_num_batched_tokens=24,
              max_model_len=256)
    assert llm.engine.runner.attn_backend == "triton"
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 21, 40)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 5)
    assert llm.engine.stats()["num_chunked_prefills"] > 0
