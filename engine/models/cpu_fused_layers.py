"""The cpu backend's decoder layers for a small step in one C++ call (kernels/cpu_ops.cpp
DecoderLayers, bound to the layers' weights once): the kernels the modules call, in their order,
without the modules' Python.

On a slow core the Llama modules' Python and dispatch around a layer's ten kernel calls cost
about 250 us a layer, a large share of a batch-1 decode step. The C++ loop calls the same kernels
on the same tensors, so its hidden states are the modules' bit for bit
(tests/engine/models/test_cpu_fused_layers.py). It is taken only where that holds, else the modules run:
- statically: every layer the dense Llama-family layer (engine/models/llama.py: Llama, Mistral,
  Qwen2's qkv bias, Qwen3's q/k norms), each weight GGUF blocks the C++ kernels read (a .gguf
  file's own, or --quantization int8/int4) or float (plain, or packed by oneDNN), no bias past
  the qkv projection, one tensor-parallel rank, a single pipeline stage;
- per step: the cpu backend, at most DEQUANT_GEMM_ROWS tokens (where cpu_quant.linear takes its
  register kernel for every block weight), activations in float32 or bfloat16 and weights, norms
  and a KV cache of that dtype (or fp8, or 16-bit under float32), and the step's attention plan.
EngineConfig.cpu_fused_layers turns it off (for measurement: the same tokens, slower).
"""

from __future__ import annotations

import functools

import torch

from engine.distributed.state import pp_state, tp_state
from engine.layers.context import get_forward_context
from engine.models.llama import MLP, DecoderLayer
from kernels.reference import is_fp8

# kernels/cpu_ops.cpp's codes for a float weight, beside the block formats' kernel ids (>= 0), and
# what a block format's id gains when the module quantizes its activations (linear_q8 / linear_q16).
PLAIN_WEIGHT, PACKED_WEIGHT = -1, -2
ACTIVATION_CODES = {None: 0, "int8": 256, "int16": 512}


def unsupported(model) -> str | None:
    """Why `model` (a LlamaModel) cannot take the fused path, or None when it can."""
    from kernels import cpu_quant

    if tp_state().size != 1 or pp_state().size != 1:
        return "tensor or pipeline parallel"
    layers = list(model.layers.values())
    if not layers:
        return "no layers"
    first = layers[0].self_attn
    for layer in layers:
        if type(layer) is not DecoderLayer or type(layer.mlp) is not MLP:
            return f"layer type {type(layer).__name__} with {type(layer.mlp).__name__}"
        attn = layer.self_attn
        linears = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        if any(m.bias is not None for m in linears[1:]):
            return "biases past the qkv projection"
        if attn.qk_norm and attn.q_norm.eps != layer.input_layernorm.eps:
            return "q/k norms of another eps"
        if any(m.quant_format is not None and m.quant_format.name not in cpu_quant.FORMATS for m in linears):
            return "a block format without a CPU kernel"
        if (attn.num_heads, attn.num_kv_heads, attn.attn.scale) != (first.num_heads, first.num_kv_heads,
                                                                     first.attn.scale):
            return "layers of different attention shapes"
        if layer.input_layernorm.eps != layers[0].input_layernorm.eps or \
                layer.post_attention_layernorm.eps != layers[0].input_layernorm.eps:
            return "norms of different eps"
    return None


class CpuFusedLayers:
    """model.layers as one kernels/cpu_ops.cpp DecoderLayers call, where it runs what they run."""

    def __init__(self, model):
        self.layers = list(model.layers.values())
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.scale = attn.num_heads, attn.num_kv_heads, attn.attn.scale
        self.eps = self.layers[0].input_layernorm.eps
        self._stack = None  # kernels/cpu_ops.cpp's DecoderLayers, bound to the layers' tensors
        self._bound_to = None  # the first layer's key cache it was bound against
        self._rows_ok: dict[tuple[int, torch.dtype], bool] = {}
        self.steps = 0  # forwards that took the fused path (the tests read it)

    def _bind(self) -> None:
        """Bind the C++ layers to the per-layer tensors, again whenever the runner allocates new caches."""
        from kernels import cpu_build, cpu_ops

        weights, formats, caches, scales = [], [], [], []
        none = torch.empty(0)  # a weight the model does not have (kernels/cpu_ops.cpp: 9 a layer)
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
            weights += [layer.input_layernorm.weight, _operand(qkv), _operand(o),
                        layer.post_attention_layernorm.weight, _operand(gate_up), _operand(down),
                        none if qkv.bias is None else qkv.bias,
                        attn.q_norm.weight if attn.qk_norm else none,
                        attn.k_norm.weight if attn.qk_norm else none]
            formats += [_format(m) for m in (qkv, o, gate_up, down)]
            caches += cpu_ops._physical(attn.attn.k_cache, attn.attn.v_cache)
            scales += [float(attn.attn.k_scale), float(attn.attn.v_scale)]
        self._stack = cpu_build.load().DecoderLayers(weights, formats, caches, scales, self.num_heads,
                                                     self.num_kv_heads, self.eps, self.scale, *_linear_kernels())
        if self.layers[0].self_attn.qkv_proj.lora is not None:  # LoRA serving: the adapters' slots, filled in place
            adapted = [m for layer in self.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                            layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            self._stack.bind_lora([t for m in adapted for t in (m.lora.a, m.lora.b)],
                                  [list(m.lora.out_slices) for m in adapted], [m.lora.filled for m in adapted],
                                  *cpu_build.load_lora().addresses())
        self._bound_to = self.layers[0].self_attn.attn.k_cache

    def _takes(self, hidden: torch.Tensor, meta) -> bool:
        from kernels import cpu_ops, cpu_quant

        attn = self.layers[0].self_attn.attn
        if attn.k_cache is None or meta.plan is None:
            return False
        cache = attn.k_cache.dtype
        if cache != hidden.dtype and not is_fp8(cache) and not cpu_ops.narrow_cache(hidden.dtype, cache):
            return False  # the modules convert other mixes (a float32 cache under 16 bits) through the reference
        key = (hidden.shape[0], hidden.dtype)
        if key not in self._rows_ok:
            ok = hidden.dtype in (torch.float32, torch.bfloat16) and hidden.shape[0] <= cpu_quant.DEQUANT_GEMM_ROWS \
                and self.layers[0].input_layernorm.weight.dtype == hidden.dtype
            for layer in self.layers if ok else ():
                for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                          layer.mlp.down_proj):
                    if m.quant_format is None:  # F.linear / oneDNN take the activations' dtype only
                        ok = ok and m.weight.dtype == hidden.dtype
                        continue
                    weights = m.weight.shape[0] * m.quant_format.in_features(m.weight.shape[1])
                    ok = ok and cpu_quant.register_rows(hidden.shape[0], weights, hidden.dtype == torch.bfloat16)
            self._rows_ok[key] = ok
        return self._rows_ok[key]

    def __call__(self, rope, hidden: torch.Tensor, residual: torch.Tensor | None):
        """(hidden, residual) after every layer, or None where the modules must run instead."""
        context = get_forward_context()
        meta = context.attn
        if context.backend.name != "cpu" or not self._takes(hidden, meta):
            return None
        if self._bound_to is not self.layers[0].self_attn.attn.k_cache:
            self._bind()
        tokens = hidden.shape[0]
        cos, sin = (t.reshape(tokens, -1).contiguous() for t in rope)
        plan = meta.plan
        out = self._stack.forward(hidden.contiguous(), None if residual is None else residual.contiguous(), cos, sin,
                                  meta.slot_mapping, plan.block_tables, plan.row_seq, plan.lens, context.lora_slots)
        self.steps += 1
        return out[0], out[1]


def _operand(linear) -> torch.Tensor:
    """What the module's matmul multiplies by: its blocks, its oneDNN-packed weight, or its weight."""
    return linear.packed_weight if linear.quant_format is None and linear.packed_weight is not None \
        else linear.weight


def _format(linear) -> int:
    """kernels/cpu_ops.cpp's code for how to multiply by _operand(linear)."""
    from kernels import cpu_quant

    if linear.quant_format is not None:
        return cpu_quant.FORMATS[linear.quant_format.name].id + ACTIVATION_CODES[linear.activations]
    return PLAIN_WEIGHT if linear.packed_weight is None else PACKED_WEIGHT


@functools.cache
def _linear_kernels() -> tuple[int, int, int, int, int]:
    """linear_f32's, linear_q8's and linear_q16's addresses and the most rows the integer ones take,
    which DecoderLayers calls as the modules do."""
    from kernels import cpu_build, cpu_quant

    quant = cpu_build.load_quant()
    return (quant.linear_f32_address(), quant.linear_q8_address(), quant.linear_q16_address(),
            cpu_quant.ACTIVATION_ROWS["int8"], cpu_quant.ACTIVATION_ROWS["int16"])
