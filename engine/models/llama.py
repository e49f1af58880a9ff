"""One decoder for the Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm).

Grouped-query attention, RoPE, RMSNorm, SwiGLU, tied or untied embeddings. Checkpoint names
follow transformers; `packed_modules` maps the separate q/k/v and gate/up tensors of a
checkpoint onto the fused parameters here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary, rope_settings


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.head_dim = head_dim_of(cfg)
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        qkv_bias = bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2"
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads, num_kv_heads, qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size,
                                        bias=bool(getattr(cfg, "attention_bias", False)))
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        o = self.attn(q, k, v, meta)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported; only 'silu' (SwiGLU)")
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2,
                                                       bias=bool(getattr(cfg, "mlp_bias", False)))
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size,
                                           bias=bool(getattr(cfg, "mlp_bias", False)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope, x, residual, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, max_positions: int, layer_range: tuple[int, int] | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        # Pipeline stages own a contiguous range of layers; single-process owns all.
        self.start_layer, self.end_layer = layer_range or (0, cfg.num_hidden_layers)
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg) for i in range(self.start_layer, self.end_layer)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        theta, scaling = rope_settings(cfg)
        self.rotary = RotaryEmbedding(head_dim_of(cfg), max_positions, theta, scaling)

    def forward(self, input_ids, positions, meta, hidden=None, residual=None):
        if self.start_layer == 0:
            hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary(positions)
        for layer in self.layers.values():
            hidden, residual = layer(rope, hidden, residual, meta)
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (parameter name fragment, shard id for its weight_loader)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg, max_positions: int, layer_range: tuple[int, int] | None = None):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions, layer_range)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, meta, hidden=None, residual=None):
        return self.model(input_ids, positions, meta, hidden, residual)

    def final_hidden(self, hidden, residual):
        """The last layer's output after the final norm (hidden states fed to the LM head)."""
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def layers(self):
        return self.model.layers.values()
