"""Gemma 2 and Gemma 3's text model (model_type "gemma2", "gemma3_text").

Llama's grouped-query attention and fused projections, with what Gemma adds:
- RMSNorms that scale by (1 + weight) in float32: the 1 is added to the weight at load, and the
  weight stays float32 whatever the model's dtype;
- a norm after attention and after the MLP as well as before each (four per layer);
- a GeGLU MLP (GELU, tanh approximation, instead of SiLU);
- embeddings scaled by sqrt(hidden_size), rounded to the model's dtype first as transformers does;
- attention scaled by query_pre_attn_scalar ** -0.5;
- a sliding window on some layers (`layer_types`), masked by the kernels over a full-length cache;
- Gemma 2: attention scores and final logits soft-capped (cap * tanh(x / cap));
- Gemma 3: q/k norms, and its own rotary base for the window layers (the full layers take
  rope_theta with its scaling), so the model keeps one cos/sin table per layer type.

Checkpoint names are transformers' Gemma2ForCausalLM / Gemma3ForCausalLM ones; those of
Gemma3ForConditionalGeneration (`model.language_model.*`, or `language_model.model.*` as 4.x saved
them) load too, and its vision tower's tensors are skipped.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.pipeline import recv_activations, send_activations
from engine.layers.attention import PagedAttention
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rope_settings
from engine.models.llama import Attention, LlamaForCausalLM, head_dim_of

GEMMA2, GEMMA3 = "gemma2", "gemma3_text"
SLIDING, FULL = "sliding_attention", "full_attention"
# A multimodal checkpoint's prefixes of the language model's tensors -> this model's.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))


def layer_types(cfg) -> list[str]:
    """Each layer's attention, SLIDING or FULL: the config's `layer_types`, else transformers' rule
    (Gemma 2 alternates from a window layer; Gemma 3 has a full layer every sliding_window_pattern)."""
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    pattern = 2 if cfg.model_type == GEMMA2 else getattr(cfg, "sliding_window_pattern", None) or 6
    return [SLIDING if (i + 1) % pattern else FULL for i in range(cfg.num_hidden_layers)]


def rope_config(cfg, layer_type: str):
    """The rotary fields of one layer type, as rope_settings reads them: transformers 5 keeps Gemma 3's
    per layer type in rope_parameters; 4.x gives its window layers rope_local_base_freq, unscaled."""
    params = getattr(cfg, "rope_parameters", None) or {}
    if layer_type in params:
        return SimpleNamespace(rope_parameters=params[layer_type], max_position_embeddings=cfg.max_position_embeddings)
    local = getattr(cfg, "rope_local_base_freq", None)
    if layer_type == SLIDING and local is not None:
        return SimpleNamespace(rope_theta=local, max_position_embeddings=cfg.max_position_embeddings)
    return cfg


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w), computed in float32 as transformers' Gemma norms compute it: the weight
    is held as 1 + w in float32. A float32 model takes the backend's fused norm; a 16-bit one
    multiplies in float32 before rounding, which that norm (weight and x in one dtype) does not."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    @staticmethod
    def weight_loader(param: nn.Parameter, loaded) -> None:
        param.data.copy_(loaded)
        param.data += 1.0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.dtype == torch.float32:
            return super().forward(x, residual)
        if residual is not None:
            x = x + residual
        wide = x.float()
        y = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)
        return y if residual is None else (y, x)


class GemmaAttention(Attention):
    """Llama's attention with Gemma's scale, q/k norms (Gemma 3), window (on SLIDING layers) and
    score soft-capping (Gemma 2)."""

    def __init__(self, cfg, layer_type: str):
        super().__init__(cfg)
        self.qk_norm = cfg.model_type == GEMMA3
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        window = cfg.sliding_window if layer_type == SLIDING else None
        cap = getattr(cfg, "attn_logit_softcapping", None) if cfg.model_type == GEMMA2 else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, cfg.query_pre_attn_scalar ** -0.5,
                                   sliding_window=window, logits_soft_cap=cap)


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate) * up)."""

    def __init__(self, cfg):
        super().__init__()
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {act!r} is not supported for Gemma; only 'gelu_pytorch_tanh'")
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = GemmaAttention(cfg, layer_type)
        self.mlp = GemmaMLP(cfg)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def forward(self, ropes: dict, x, residual):
        """As transformers' layer, with each residual add fused into the norm after it: returns the
        MLP's normed output and the residual stream it is still to be added to."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(ropes[self.layer_type], x))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    """The decoder layers of one pipeline stage, as LlamaModel (engine/models/llama.py) holds them,
    with a rotary table per layer type, each looked up once a step."""

    def __init__(self, cfg, max_positions: int, layer_range: tuple[int, int] | None):
        super().__init__()
        self.start_layer, self.end_layer = layer_range or (0, cfg.num_hidden_layers)
        self.hidden_size = cfg.hidden_size
        self.dtype = torch.get_default_dtype()
        first, last = self.start_layer == 0, self.end_layer == cfg.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if first else None
        # transformers rounds sqrt(hidden_size) to the model's dtype before scaling the embeddings.
        self.normalizer = float(torch.tensor(cfg.hidden_size ** 0.5, dtype=self.dtype))
        types = layer_types(cfg)
        self.layers = nn.ModuleDict({str(i): GemmaDecoderLayer(cfg, types[i])
                                     for i in range(self.start_layer, self.end_layer)})
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if last else None
        self.rotary = nn.ModuleDict({
            kind: RotaryEmbedding(head_dim_of(cfg), max_positions, *rope_settings(rope_config(cfg, kind)))
            for kind in sorted({layer.layer_type for layer in self.layers.values()})})

    def forward(self, input_ids, positions):
        if self.embed_tokens is not None:
            hidden, residual = self.embed_tokens(input_ids) * self.normalizer, None
        else:
            hidden, residual = recv_activations(input_ids.shape[0], self.hidden_size, self.dtype, input_ids.device)
        ropes = {kind: rotary(positions, self.dtype) for kind, rotary in self.rotary.items()}
        for layer in self.layers.values():
            hidden, residual = layer(ropes, hidden, residual)
        if self.norm is None:
            send_activations(hidden, residual)
        return hidden, residual


class GemmaForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg, max_positions: int, layer_range: tuple[int, int] | None = None):
        nn.Module.__init__(self)
        self.config = cfg
        self.model = GemmaModel(cfg, max_positions, layer_range)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size) if self.model.norm is not None else None
        self.final_logit_softcapping = getattr(cfg, "final_logit_softcapping", None)
        self.tie_weights()

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        for prefix, ours in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = ours + name[len(prefix):]
                break
        return super().checkpoint_target(name)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        if cap is None or self.lm_head is None:
            return logits
        return torch.tanh(logits / cap) * cap
