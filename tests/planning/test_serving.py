"""KV sizing: the functions the engine calls to size its paged KV cache."""

import pytest

from engine.planning import ModelSpec, kv_budget_bytes, kv_bytes_per_token, kv_capacity_tokens, plan_serving
from engine.planning.units import GiB


def test_llama2_7b_kv_cache_is_524288_bytes_per_token_in_fp16():
    # Published: 2 (K, V) x 32 layers x 32 heads x 128 head_dim x 2 bytes = 512 KiB per token. Exact.
    assert kv_bytes_per_token(ModelSpec.from_preset("llama-2-7b"), 2) == 524_288


def test_kv_heads_split_over_tp_and_replicated_beyond_kv_heads():
    spec = ModelSpec.from_preset("llama-3-70b")  # 80 layers, 8 KV heads, head_dim 128
    assert kv_bytes_per_token(spec, 2) == 2 * 80 * 8 * 128 * 2
    assert kv_bytes_per_token(spec, 2, tp=8) == 2 * 80 * 1 * 128 * 2
    assert kv_bytes_per_token(spec, 2, tp=16) == kv_bytes_per_token(spec, 2, tp=8)  # replicated
    assert kv_bytes_per_token(spec, 2, pp=3) == 2 * 27 * 8 * 128 * 2  # busiest stage: ceil(80 / 3)


def test_capacity_counts_whole_blocks_and_budget_never_negative():
    assert kv_capacity_tokens(1000, 10, 16) == 96  # 6 blocks of 160 bytes; the 40 left over is unusable
    assert kv_budget_bytes(80 * GiB, 0.9, 100 * GiB) == 0
    assert kv_budget_bytes(100, 0.5, 20) == 30


def test_fixed_kv_budget_replaces_the_gpu_one():
    spec = ModelSpec.from_preset("qwen2.5-0.5b")
    plan = plan_serving(spec, dtype_bytes=4, kv_dtype_bytes=4, max_model_len=1024, kv_cache_memory_bytes=2 * GiB)
    per_token = 2 * 24 * 2 * 64 * 4
    assert plan.kv_bytes_per_token == per_token
    assert plan.kv_capacity_tokens == kv_capacity_tokens(2 * GiB, per_token, 16)
    assert plan.max_seqs_at_max_len == plan.kv_capacity_tokens // 1024


def test_from_hf_config_dicts_of_the_engine_models():
    transformers = pytest.importorskip("transformers")
    llama = ModelSpec.from_hf_config(transformers.LlamaConfig(num_key_value_heads=None).to_dict())
    assert llama.num_kv_heads == llama.num_heads  # missing -> heads
    qwen3 = ModelSpec.from_hf_config(transformers.Qwen3Config(hidden_size=1024, num_attention_heads=16,
                                                              num_key_value_heads=8, head_dim=128).to_dict())
    assert qwen3.head_dim == 128 and qwen3.qk_norm  # explicit head_dim beats hidden / heads
    qwen2 = ModelSpec.from_hf_config(transformers.Qwen2Config().to_dict())
    assert qwen2.qkv_bias and not qwen2.out_bias


def test_config_json_file_or_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                        num_attention_heads=8, num_key_value_heads=2)
    config.save_pretrained(tmp_path)
    from_dict = ModelSpec.from_hf_config(config.to_dict())
    assert ModelSpec.from_hf_config(tmp_path) == from_dict == ModelSpec.from_hf_config(tmp_path / "config.json")
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelSpec.from_hf_config({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4})
