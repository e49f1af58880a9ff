"""Published model configurations, written as the Hugging Face config.json keys they ship with.

Values are copied from each model's config.json on the Hugging Face Hub (GPT-3 175B from Brown et
al. 2020, Table 2.1: the GPT-2 architecture at 96 layers, d_model 12288, 96 heads, context 2048,
dropout 0.1; trained as Korthikanti et al. 2022 assume, with a fused GELU kernel).
"""

from __future__ import annotations


def _llama(layers, hidden, heads, kv_heads, ffn, vocab, max_pos, model_type="llama", tie=False):
    return {
        "model_type": model_type, "num_hidden_layers": layers, "hidden_size": hidden,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "intermediate_size": ffn,
        "vocab_size": vocab, "max_position_embeddings": max_pos, "tie_word_embeddings": tie,
    }


def _moe(model_type, layers, hidden, heads, kv_heads, ffn, vocab, max_pos, experts, top_k, **fields):
    expert_key = "num_local_experts" if model_type == "mixtral" else "num_experts"
    return _llama(layers, hidden, heads, kv_heads, ffn, vocab, max_pos, model_type) | {
        expert_key: experts, "num_experts_per_tok": top_k, **fields}


def _gpt(layers, hidden, heads, vocab, positions, activation):
    return {
        "model_type": "gpt2", "n_layer": layers, "n_embd": hidden, "n_head": heads, "n_inner": None,
        "vocab_size": vocab, "n_positions": positions, "tie_word_embeddings": True,
        "activation_function": activation, "attn_pdrop": 0.1, "resid_pdrop": 0.1,
    }


PRESETS: dict[str, dict] = {
    "gpt2": _gpt(12, 768, 12, 50257, 1024, "gelu_new"),
    # LLaMA (Touvron et al. 2023, Table 2; huggyllama/llama-7b, llama-65b): the models QLoRA was measured on
    "llama-7b": _llama(32, 4096, 32, 32, 11008, 32000, 2048),
    "llama-65b": _llama(80, 8192, 64, 64, 22016, 32000, 2048),
    "llama-2-7b": _llama(32, 4096, 32, 32, 11008, 32000, 4096),
    "llama-2-13b": _llama(40, 5120, 40, 40, 13824, 32000, 4096),
    "llama-2-70b": _llama(80, 8192, 64, 8, 28672, 32000, 4096),
    "llama-3-8b": _llama(32, 4096, 32, 8, 14336, 128256, 8192),
    "llama-3-70b": _llama(80, 8192, 64, 8, 28672, 128256, 8192),
    "qwen2.5-0.5b": _llama(24, 896, 14, 2, 4864, 151936, 32768, model_type="qwen2", tie=True),
    "qwen2.5-7b": _llama(28, 3584, 28, 4, 18944, 152064, 32768, model_type="qwen2"),
    "mistral-7b": _llama(32, 4096, 32, 8, 14336, 32000, 32768, model_type="mistral"),
    "gpt3-175b": _gpt(96, 12288, 96, 50257, 2048, "gelu_pytorch_tanh"),  # fused GELU, as Megatron-LM
    # mistralai/Mixtral-8x7B-v0.1: 8 experts of intermediate_size, top-2, every layer
    "mixtral-8x7b": _moe("mixtral", 32, 4096, 32, 8, 14336, 32000, 32768, 8, 2),
    # Qwen/Qwen3-30B-A3B: head_dim 128 (not 2048 / 32), 128 experts of 768, top-8, every layer MoE
    "qwen3-30b-a3b": _moe("qwen3_moe", 48, 2048, 32, 4, 6144, 151936, 40960, 128, 8, head_dim=128,
                          moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[]),
}
