"""Phi-3 and Phi-4-mini (model_type "phi3"): the Llama decoder, with checkpoints that store q/k/v as one
`qkv_proj` matrix and gate/up as one `gate_up_proj`, a partial rotary factor (Phi-4-mini rotates 3/4 of
each head) and LongRoPE scaling (engine/layers/rotary.py).

The fused matrices are split into their parts on load, so each part takes the same tensor-parallel
path as a Llama checkpoint's. Under partial rotary the q and k rows of each head load in
`partial_rotary_order`, so the kernels' whole-head half rotation rotates the pairs transformers does.
"""

from __future__ import annotations

import torch

from engine.layers.rotary import partial_rotary_order, rope_settings, rotary_dim
from engine.models.llama import LlamaForCausalLM, head_dim_of
from engine.quant import QuantizedTensor


def _rows(tensor, order: torch.Tensor):
    """`tensor`'s rows in `order` (a float tensor, a lazily read checkpoint slice, or quantized blocks)."""
    if isinstance(tensor, QuantizedTensor):
        return QuantizedTensor(tensor.blocks[order], tensor.format)
    return torch.index_select(tensor, 0, order)  # a checkpoint slice is read here, whole


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg, max_positions: int, layer_range: tuple[int, int] | None = None):
        super().__init__(cfg, max_positions, layer_range)
        head_dim = head_dim_of(cfg)
        self.q_size = cfg.num_attention_heads * head_dim
        self.kv_size = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim
        rotary = rotary_dim(head_dim, rope_settings(cfg)[1])
        self.head_order = partial_rotary_order(head_dim, rotary) if rotary < head_dim else None

    def _in_head_order(self, tensor, rows: int):
        """q or k rows [heads * head_dim, ...] with each head's rows in head_order."""
        if self.head_order is None:
            return tensor
        head_dim = self.head_order.numel()
        order = (torch.arange(0, rows, head_dim)[:, None] + self.head_order).flatten()
        return _rows(tensor, order)

    def checkpoint_parts(self, name: str, tensor) -> list[tuple[str, object]]:
        """The separate tensors a fused checkpoint tensor holds, named as a Llama checkpoint names them."""
        if ".qkv_proj." in name:
            q, k, v = (tensor.narrow(0, start, size) for start, size in
                       ((0, self.q_size), (self.q_size, self.kv_size), (self.q_size + self.kv_size, self.kv_size)))
            return [(name.replace(".qkv_proj.", ".q_proj."), self._in_head_order(q, self.q_size)),
                    (name.replace(".qkv_proj.", ".k_proj."), self._in_head_order(k, self.kv_size)),
                    (name.replace(".qkv_proj.", ".v_proj."), v)]
        if ".gate_up_proj." in name:
            inter = tensor.shape[0] // 2
            return [(name.replace(".gate_up_proj.", ".gate_proj."), tensor.narrow(0, 0, inter)),
                    (name.replace(".gate_up_proj.", ".up_proj."), tensor.narrow(0, inter, inter))]
        return [(name, tensor)]
