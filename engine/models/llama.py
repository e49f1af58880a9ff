"""One decoder for the Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm).
Their mixture-of-experts siblings (engine/models/moe.py) are this decoder with another MLP.

Grouped-query attention, RoPE, RMSNorm, SwiGLU, tied or untied embeddings. Checkpoint names
follow transformers; `packed_modules` maps the separate q/k/v and gate/up tensors of a
checkpoint onto the fused parameters here.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.attention import PagedAttention
from engine.layers.context import get_forward_context
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rope_settings
from engine.distributed.pipeline import recv_activations, send_activations


# model_type -> what its attention has beyond Llama's; a MoE sibling has its dense twin's attention.
QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.head_dim = head_dim_of(cfg)
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        qkv_bias = bool(getattr(cfg, "attention_bias", False)) or cfg.model_type in QKV_BIAS_TYPES
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads, num_kv_heads,
                                          qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size,
                                        bias=bool(getattr(cfg, "attention_bias", False)))
        self.qk_norm = cfg.model_type in QK_NORM_TYPES
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        heads = self.num_heads + self.num_kv_heads
        # q and k sit side by side in each row: rotate them as one [T, heads, D] view, one pass.
        qk = qkv[:, : heads * self.head_dim].view(-1, heads, self.head_dim)
        v = qkv[:, heads * self.head_dim:].view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        o = self.attn(qk, v, rope)  # rotary inside: the backend fuses it with the KV store
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    """SwiGLU. `intermediate_size` defaults to the config's (a MoE model's shared expert has its
    own); `reduce_results=False` leaves the TP partial sums to the caller (who adds more first)."""

    def __init__(self, cfg, intermediate_size: int | None = None, reduce_results: bool = True):
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported; only 'silu' (SwiGLU)")
        inter = intermediate_size or cfg.intermediate_size
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter] * 2, bias=bias)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=bias, reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(get_forward_context().backend.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, mlp: nn.Module, attention: nn.Module | None = None):
        super().__init__()
        self.self_attn = attention if attention is not None else Attention(cfg)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope, x, residual):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """The decoder layers of one pipeline stage (a single process is the one stage owning all).
    The first stage embeds the tokens, the others receive the previous stage's hidden states and
    residual stream; the last stage keeps the final norm, the others send their output on.
    Runs inside a forward context (engine/layers/context.py): the step's attention metadata and
    the kernel backend reach every layer through it."""

    def __init__(self, cfg, max_positions: int, layer_range: tuple[int, int] | None, make_mlp, make_attention=None):
        super().__init__()
        self.start_layer, self.end_layer = layer_range or (0, cfg.num_hidden_layers)
        self.hidden_size = cfg.hidden_size
        self.dtype = torch.get_default_dtype()  # the model's (the runner builds it under its dtype)
        first, last = self.start_layer == 0, self.end_layer == cfg.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if first else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, make_mlp(cfg, i),
                                                          make_attention(cfg, i) if make_attention else None)
                                     for i in range(self.start_layer, self.end_layer)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if last else None
        theta, scaling = rope_settings(cfg)
        self.rotary = RotaryEmbedding(head_dim_of(cfg), max_positions, theta, scaling)
        # The runner may set a callable running every layer at once where that is the same
        # computation (engine/models/cpu_fused_layers.py); it returns None where it is not.
        self.fused_layers = None

    def forward(self, input_ids, positions):
        if self.embed_tokens is not None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = recv_activations(input_ids.shape[0], self.hidden_size, self.dtype, input_ids.device)
        rope = self.rotary(positions, self.dtype)  # not norm.weight's: only the last stage has the norm
        fused = self.fused_layers(rope, hidden, residual) if self.fused_layers is not None else None
        if fused is not None:
            hidden, residual = fused
        else:
            for layer in self.layers.values():
                hidden, residual = layer(rope, hidden, residual)
        if self.norm is None:
            send_activations(hidden, residual)
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
        self.model = LlamaModel(cfg, max_positions, layer_range, self.make_mlp, self.make_attention)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size) if self.model.norm is not None else None
        self.tie_weights()

    def tie_weights(self) -> None:
        """With tied embeddings the LM head reads the embedding's matrix; again after the loader
        changes how the embedding holds it (quantize_weight). A last pipeline stage without the
        embeddings keeps its own copy as the head (loaded from them)."""
        if self.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.tie(self.model.embed_tokens)

    @staticmethod
    def make_mlp(cfg, layer: int) -> nn.Module:
        """Layer `layer`'s MLP: dense here; a mixture-of-experts family routes some layers."""
        return MLP(cfg)

    @staticmethod
    def make_attention(cfg, layer: int) -> nn.Module:
        """Layer `layer`'s attention: Llama's here; a family with window layers or sinks differs per layer."""
        return Attention(cfg)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """(parameter name, shard id or None) that checkpoint tensor `name` loads into: the
        separate q/k/v and gate/up tensors go to their fused parameter (`packed_modules`)."""
        for ckpt_part, (param_part, shard) in self.packed_modules.items():
            if f".{ckpt_part}." in name:
                return name.replace(f".{ckpt_part}.", f".{param_part}."), shard
        return name, None

    def forward(self, input_ids, positions):
        return self.model(input_ids, positions)

    def final_hidden(self, hidden, residual):
        """The last layer's output after the final norm (hidden states fed to the LM head).
        Before the last pipeline stage there is no norm: the hidden states pass through."""
        if self.model.norm is None:
            return hidden
        hidden, _ = self.model.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            # Not the last stage: logits of the right shape and no contents; rank 0 receives the
            # real ones from the last stage into a buffer of this shape (engine.distributed.pipeline).
            return hidden.new_empty(()).expand(hidden.shape[0], self.config.vocab_size)
        return self.lm_head(hidden)

    def layers(self):
        return self.model.layers.values()
