"""gpt-oss (model_type "gpt_oss"): Llama's decoder with
- attention biases on q/k/v/o, and a learned sink per query head: one more logit in each row's
  softmax that takes probability mass and adds nothing (the kernels' `sinks`);
- sliding-window layers alternating with full ones (`layer_types`), masked by the kernels over a
  full-length cache, so the context is the model's, not the window;
- YaRN rotary (engine/layers/rotary.py);
- a mixture-of-experts MLP in every layer: a router with a bias picks each token's top-k experts and
  weighs them by the softmax of their logits; an expert's gate/up projection (interleaved columns,
  with a bias) feeds a clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate) with gate <= limit and
  |up| <= limit, then its down projection (with a bias).

Checkpoints are transformers' GptOssForCausalLM: the experts stacked per layer, in bf16 or as the
released MXFP4 blocks and scales (`*_blocks`, `*_scales`), which are dequantized at load
(engine/quant/mxfp4.py). The experts run as torch ops, one matmul pair per expert a step uses; tensor
parallelism is refused for now (the experts would need their own split).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.state import tp_state
from engine.layers.attention import PagedAttention
from engine.models.llama import Attention, LlamaForCausalLM
from engine.quant.mxfp4 import dequantize_mxfp4

SLIDING = "sliding_attention"
EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def layer_types(cfg) -> list[str]:
    """Each layer's attention: the config's `layer_types`, else transformers' default (window layers first)."""
    return list(getattr(cfg, "layer_types", None) or
                [SLIDING if (i + 1) % 2 else "full_attention" for i in range(cfg.num_hidden_layers)])


class GptOssAttention(Attention):
    def __init__(self, cfg, layer_type: str):
        super().__init__(cfg)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks
        window = cfg.sliding_window if layer_type == SLIDING else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                                   sliding_window=window, sinks=self.sinks)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's query heads' sinks."""
        param.data.copy_(loaded.narrow(0, tp_state().rank * self.num_heads, self.num_heads))


class GptOssExperts(nn.Module):
    """Every expert of one layer, stacked as transformers stores them: gate_up_proj [E, H, 2F] (gate and
    up columns interleaved), down_proj [E, F, H], and their biases."""

    def __init__(self, cfg):
        super().__init__()
        experts, hidden, ffn = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        shapes = {"gate_up_proj": (experts, hidden, 2 * ffn), "gate_up_proj_bias": (experts, 2 * ffn),
                  "down_proj": (experts, ffn, hidden), "down_proj_bias": (experts, hidden)}
        for name, shape in shapes.items():
            param = nn.Parameter(torch.empty(shape), requires_grad=False)
            param.weight_loader = self._loader(name)
            setattr(self, name, param)
        self._halves: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4: blocks or scales waiting for the other

    def _loader(self, name: str):
        def load(param: nn.Parameter, loaded: torch.Tensor, part: str | None = None) -> None:
            if part is None:
                param.data.copy_(loaded)
                return
            halves = self._halves.setdefault(name, {})
            halves[part] = loaded if isinstance(loaded, torch.Tensor) else loaded.read()  # a lazy checkpoint slice
            if len(halves) == 2:  # [E, rows, cols] dequantized; stored transposed, as the float checkpoints
                param.data.copy_(dequantize_mxfp4(halves["blocks"], halves["scales"]).transpose(1, 2))
                del self._halves[name]
        return load

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in torch.unique(ids).tolist():
            tokens, slot = torch.where(ids == expert)
            gate_up = x[tokens] @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
            gate = gate_up[:, ::2].clamp(max=self.limit)
            up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
            glu = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
            y = glu @ self.down_proj[expert] + self.down_proj_bias[expert]
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
        return out


class GptOssMoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if tp_state().size > 1:
            raise ValueError("gpt-oss with tensor_parallel_size > 1 is not supported yet (its experts are not split "
                             "over ranks): serve it on one rank per pipeline stage (--pipeline-parallel-size)")
        self.top_k = cfg.num_experts_per_tok
        self.router = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=True)
        self.experts = GptOssExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, ids = torch.topk(F.linear(x, self.router.weight, self.router.bias), self.top_k, dim=-1)
        return self.experts(x, torch.softmax(top, dim=-1, dtype=top.dtype), ids)


class GptOssForCausalLM(LlamaForCausalLM):
    @staticmethod
    def make_mlp(cfg, layer: int) -> nn.Module:
        return GptOssMoE(cfg)

    @staticmethod
    def make_attention(cfg, layer: int) -> nn.Module:
        return GptOssAttention(cfg, layer_types(cfg)[layer])

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """An MXFP4 expert tensor's blocks and scales both load into its float parameter, which
        dequantizes once it has the two."""
        for suffix in ("_blocks", "_scales"):
            if name.endswith(suffix) and ".mlp.experts." in name:
                return name[:-len(suffix)], suffix[1:]
        return super().checkpoint_target(name)
