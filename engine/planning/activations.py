"""Activation memory: the tensors a training forward pass keeps for backward, counted op by op.

One count serves two masters. For the architecture Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models") assume - GPT with a 4h MLP, fused LayerNorm and GELU,
dropout, 16-bit activations, attention that materializes the softmax - it reproduces their Table 2:
sbh(34 + 5as/h) bytes per layer, and the TP / SP / selective / full-recomputation variants. For other
architectures (SwiGLU, RMSNorm as Hugging Face writes it, GQA, FlashAttention) the same per-op rules
give the count, checked against PyTorch's saved tensors in tests/planning/test_measured.py.

What autograd keeps, op by op (the rules every entry below follows):
  linear layer: its input          GELU / SiLU (fused kernels): their input
  product of two activations: both  softmax: its output          dropout (CUDA): a 1-byte mask
  fused LayerNorm: input + fp32 mean and rstd per token
  HF RMSNorm: input in fp32, fp32 rstd per token, and the normalized value the weight multiplies
  residual add, reshape, rotary multiply by cos/sin tables: nothing per token

LoRA (lora.py) freezes the base, and autograd keeps a tensor that only a frozen weight's gradient would
need no more (it saves a matmul's input only when the weight requires a gradient): a linear layer's input
is kept only where an adapter's A reads it, a norm's normalized value (the weight's factor) never, nor the
LM head's input or the token ids. Each targeted projection adds A's r-wide output (B's input) and, where A
reads a copy of its input, that copy: the dropped copy and its mask with lora_dropout, or, for PEFT's
float32 adapters under 16-bit autocast (--dtype mixed), the 16-bit cast autocast makes of it; autocast's
16-bit copies of A and B are kept too, per layer rather than per token. The
embedding's output is taken to require a gradient (`enable_input_require_grads`, which PEFT's
prepare_model_for_kbit_training and transformers' Trainer under gradient checkpointing set); routed
experts' tensors are counted as in full fine-tuning, an upper bound.

Known gap: Hugging Face's eager Llama attention runs softmax in fp32 and, in 16-bit training, also
keeps the 16-bit copy (4as bytes per token per layer beyond this count). Eager here means Megatron's
kernel, which keeps the probabilities once in the activation dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.planning.lora import LoraSpec, adapter_tensors, targeted_projections
from engine.planning.spec import ModelSpec

ATTENTION_KERNELS = ("eager", "flash")
RECOMPUTE = ("none", "selective", "full")
# Activations Hugging Face writes as Python arithmetic rather than one kernel, with the number of
# ffn-sized tensors they keep: NewGELU keeps fc output, tanh output, 0.5x, 1 + tanh and its output.
UNFUSED_ACTIVATION_TENSORS = {"gelu_new": 5}
INT64, FP32, MASK = 8, 4, 1


@dataclass(frozen=True)
class Saved:
    """One tensor a layer keeps, in bytes per token on one TP rank."""

    name: str
    bytes_per_token: float
    # Outside Megatron's tensor-parallel region (norms, their outputs, residual dropout): every TP
    # rank holds all of it unless sequence parallelism splits it along the sequence (Korthikanti §4.2.2).
    outside_tp: bool = False
    # Part of QK^T -> softmax -> dropout -> AV, which selective recomputation recomputes (§4.3).
    core_attention: bool = False
    # The weights whose gradient alone needs it ("norm", "embed", "lm_head", or LoRA targets): with the base
    # frozen it is kept only where an adapter reads it.
    weights: tuple[str, ...] = ()


def _norm(spec: ModelSpec, act_bytes: int, name: str) -> list[Saved]:
    h = spec.hidden_size
    if spec.norm == "layernorm":
        return [Saved(f"{name}.input", act_bytes * h, True), Saved(f"{name}.mean_rstd", 2 * FP32, True)]
    return [
        Saved(f"{name}.input_fp32", FP32 * h, True),
        Saved(f"{name}.rstd", FP32, True),
        Saved(f"{name}.normalized", act_bytes * h, True, weights=("norm",)),
    ]


def layer_saved_tensors(spec: ModelSpec, seq_len: int, act_bytes: int, attention: str = "flash",
                        tp: int = 1, moe: bool | None = None, lora: LoraSpec | None = None) -> list[Saved]:
    """Everything one layer keeps for backward without recomputation, per token on one TP rank.
    `moe`: an MoE layer rather than a dense one (default: an MoE layer if the model has any)."""
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention must be one of {ATTENTION_KERNELS}, got {attention!r}")
    h, d, b = spec.hidden_size, spec.head_dim, act_bytes
    heads, kv_heads, ffn = spec.num_heads // tp, max(1, spec.num_kv_heads // tp), spec.ffn_hidden_size // tp
    saved: list[Saved] = []
    for block in ("attention", "mlp"):
        saved += _norm(spec, b, f"{block}_norm")
        first = ("q", "k", "v") if block == "attention" else ("gate", "up")
        saved.append(Saved(f"{block}_norm.output", b * h, True, weights=first))  # input of the QKV / first MLP linear
        if spec.hidden_dropout:
            saved.append(Saved(f"{block}_residual_dropout.mask", MASK * h, True))
    if spec.qk_norm:  # Qwen3: RMSNorm over head_dim on each query and key head
        for name, n in (("q_norm", heads), ("k_norm", kv_heads)):
            saved += [Saved(name, FP32 * n * d + FP32 * n), Saved(f"{name}.normalized", b * n * d, weights=("norm",))]
    if attention == "eager":
        # matmul(Q, K^T) keeps Q and K; matmul(P, V) keeps P and V. K and V are first repeated to all
        # query heads (HF repeat_kv, Megatron's expand), so with GQA they are stored at `heads` size.
        saved += [Saved("q", b * heads * d), Saved("k_repeated", b * heads * d), Saved("v_repeated", b * heads * d)]
        saved.append(Saved("softmax.output", b * heads * seq_len, core_attention=True))
        if spec.attention_dropout:
            saved.append(Saved("attention_dropout.mask", MASK * heads * seq_len, core_attention=True))
            saved.append(Saved("attention_dropout.output", b * heads * seq_len, core_attention=True))
        saved.append(Saved("attention.output", b * heads * d, weights=("o",)))  # a contiguous copy, o_proj's input
    else:
        # FlashAttention (Dao et al. 2022) keeps q, k, v, its output (also o_proj's input) and the
        # fp32 softmax log-sum-exp per head; the s x s scores are recomputed in backward.
        saved += [Saved("q", b * heads * d), Saved("k", b * kv_heads * d), Saved("v", b * kv_heads * d)]
        saved += [Saved("attention.output", b * heads * d), Saved("softmax.logsumexp", FP32 * heads)]
    if moe is None:
        moe = bool(spec.moe_layers)
    if moe:
        saved += _moe_saved_tensors(spec, act_bytes, tp)
    elif spec.mlp == "swiglu":
        # gate output (SiLU input), SiLU output and up output (the two factors), their product (down input)
        saved += [Saved("mlp.swiglu", 3 * b * ffn), Saved("mlp.down_input", b * ffn, weights=("down",))]
    else:
        # fc output (GELU input) and GELU output (second linear's input); unfused GELU keeps more
        saved += [Saved("mlp.gelu", (UNFUSED_ACTIVATION_TENSORS.get(spec.activation, 2) - 1) * b * ffn),
                  Saved("mlp.down_input", b * ffn, weights=("down",))]
    if lora is not None:
        saved = frozen_base(saved, lora) + lora_saved_tensors(spec, lora, act_bytes, tp, moe)
    return saved


def frozen_base(saved: list[Saved], lora: LoraSpec | None) -> list[Saved]:
    """What a frozen base still keeps: all but the tensors only a weight's gradient needs, unless an
    adapter's A reads that very tensor (targeted, no dropout, no cast copy)."""
    if lora is None:
        return saved
    reads = () if lora.lora_dropout or lora.copies_input else lora.target_modules
    return [t for t in saved if not t.weights or any(w in reads for w in t.weights)]


def lora_saved_tensors(spec: ModelSpec, lora: LoraSpec, b: int, tp: int, moe: bool) -> list[Saved]:
    """The adapters of one layer: A's output (r wide on every TP rank: a row-parallel A's partial sums are
    all-reduced) and, where A reads a copy of its input, the copy (with dropout, and its mask; a row-parallel
    input is split over TP)."""
    saved = []
    for p in targeted_projections(spec, lora):
        if p.place == ("dense" if moe else "moe"):
            continue
        saved.append(Saved(f"{p.name}.lora_A.output", b * lora.r))
        if lora.lora_dropout or lora.copies_input:
            width = p.in_features // tp if p.row_parallel else p.in_features
            saved.append(Saved(f"{p.name}.lora_A.input", (b + (MASK if lora.lora_dropout else 0)) * width))
    return saved


def _moe_saved_tensors(spec: ModelSpec, b: int, tp: int) -> list[Saved]:
    """An MoE block, per token: the router's fp32 softmax output over the experts and its top-k indices;
    for each of the k experts the token visits, its gathered input (the expert's linear input), the
    SwiGLU tensors of a dense MLP and the expert's output with its routing weight (a product of two
    activations); the shared expert like a dense MLP, with its sigmoid gate's output and the product."""
    k, h, fe, fs = spec.experts_per_token, spec.hidden_size, spec.expert_ffn_size // tp, spec.shared_expert_ffn_size
    saved = [Saved("router.probs", FP32 * spec.num_experts), Saved("router.topk_indices", INT64 * k),
             Saved("experts.input", k * b * h), Saved("experts.swiglu", k * 4 * b * fe),
             Saved("experts.output_and_weight", k * (b * h + FP32))]
    if fs:
        saved += [Saved("shared_expert.swiglu", 4 * b * fs // tp), Saved("shared_expert.gate", b + b * h)]
    return saved


def layer_activation_bytes(
    spec: ModelSpec,
    seq_len: int,
    micro_batch: int,
    act_bytes: int,
    *,
    attention: str = "flash",
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    moe: bool | None = None,
    lora: LoraSpec | None = None,
) -> int:
    """Bytes one layer keeps for one micro-batch on one GPU (Korthikanti et al. 2022, Table 2)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    tokens = seq_len * micro_batch
    sp = tp if sequence_parallel else 1
    if recompute == "full":
        # §4.1: only the layer's input is checkpointed (2sbh in fp16), split along the sequence with SP
        return math.ceil(tokens * act_bytes * spec.hidden_size / sp)
    kept = [t for t in layer_saved_tensors(spec, seq_len, act_bytes, attention, tp, moe, lora)
            if not (recompute == "selective" and t.core_attention)]
    cast = 0 if lora is None else adapter_cast_bytes(spec, lora, act_bytes, tp, bool(spec.moe_layers) if moe is None
                                                     else moe)
    return math.ceil(tokens * sum(t.bytes_per_token / (sp if t.outside_tp else 1) for t in kept)) + cast


def adapter_cast_bytes(spec: ModelSpec, lora: LoraSpec, act_bytes: int, tp: int, moe: bool) -> int:
    """The 16-bit copies autocast makes of one layer's float32 A and B (PEFT's adapters under --dtype mixed):
    the matmuls keep them for their input gradients, per layer and micro-batch rather than per token."""
    if not lora.copies_input:
        return 0
    layers = {"layer": spec.num_layers, "dense": spec.num_layers - len(spec.moe_layers), "moe": len(spec.moe_layers)}
    adapters = adapter_tensors(spec, lora)
    return act_bytes * sum(spec.extra_tensors_per_gpu([t for t in adapters if t.place == place], tp).elements
                           // layers[place] for place in ("layer", "moe" if moe else "dense") if layers[place])


def first_stage_saved_tensors(spec: ModelSpec) -> list[Saved]:
    """Kept by the embedding: the token ids (int64), and the embedding dropout mask."""
    saved = [Saved("token_ids", INT64, weights=("embed",))]
    if spec.hidden_dropout:
        saved.append(Saved("embedding_dropout.mask", MASK * spec.hidden_size, True))
    return saved


def last_stage_saved_tensors(spec: ModelSpec, act_bytes: int, tp: int = 1) -> list[Saved]:
    """Kept by the final norm, the LM head (its input) and the loss: Hugging Face's loss upcasts
    logits to fp32 and log_softmax keeps its fp32 output, over the rank's share of the vocabulary."""
    return _norm(spec, act_bytes, "final_norm") + [
        Saved("final_norm.output", act_bytes * spec.hidden_size, True, weights=("lm_head",)),
        Saved("log_probs", FP32 * -(-spec.vocab_size // tp)),
        Saved("labels", INT64),
    ]


def per_micro_batch_bytes(spec: ModelSpec, seq_len: int, act_bytes: int, recompute: str,
                          frozen: bool = False) -> int:
    """Tensors shared by the whole micro-batch and every layer: learned-position ids (int64, one row; none
    for a `frozen` position table), or the rotary cos and sin tables that the layers keep unless they are
    fully recomputed."""
    if spec.learned_positions:
        return 0 if frozen else INT64 * seq_len
    return 0 if recompute == "full" else 2 * seq_len * spec.head_dim * act_bytes


@dataclass(frozen=True)
class ActivationMemory:
    per_layer: int  # one layer, one micro-batch: the quantity of Korthikanti et al. Table 2 (MoE: an MoE layer)
    stored: int  # kept for backward on the busiest pipeline stage at the peak of its schedule
    recompute_buffer: int  # rebuilt during backward: one layer (full) or its core attention (selective)

    @property
    def total(self) -> int:
        return self.stored + self.recompute_buffer


def activation_memory(
    spec: ModelSpec,
    seq_len: int,
    micro_batch: int,
    act_bytes: int,
    *,
    attention: str = "flash",
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    pp: int = 1,
    num_micro_batches: int = 1,
    lora: LoraSpec | None = None,
) -> ActivationMemory:
    """Activation bytes on the busiest GPU of a TP x PP layout under the 1F1B pipeline schedule.

    Stage i (of pp) holds min(pp - i, m) micro-batches in flight (Narayanan et al. 2021, §2.2), so the
    first stage keeps pp micro-batches of its L/pp layers: L layers' worth, as Korthikanti §4.2.3 notes.
    The first stage adds the embedding's tensors, the last the head's and the loss's. An MoE model's
    dense and MoE layers are counted each as what they are.
    """
    layer_kw = dict(attention=attention, tp=tp, sequence_parallel=sequence_parallel, lora=lora)
    per_layer = layer_activation_bytes(spec, seq_len, micro_batch, act_bytes, recompute=recompute, **layer_kw)
    per_dense = layer_activation_bytes(spec, seq_len, micro_batch, act_bytes, recompute=recompute, moe=False,
                                       **layer_kw)
    moe_layers = set(spec.moe_layers)
    tokens, sp = seq_len * micro_batch, tp if sequence_parallel else 1

    def tokens_bytes(saved: list[Saved]) -> int:
        return math.ceil(tokens * sum(t.bytes_per_token / (sp if t.outside_tp else 1) for t in saved))

    first, last = (tokens_bytes(frozen_base(first_stage_saved_tensors(spec), lora)),
                   tokens_bytes(frozen_base(last_stage_saved_tensors(spec, act_bytes, tp), lora)))
    shared = per_micro_batch_bytes(spec, seq_len, act_bytes, recompute, frozen=lora is not None)
    base, extra = divmod(spec.num_layers, pp)
    starts = [stage * base + min(stage, extra) for stage in range(pp + 1)]
    stored = max(
        min(pp - stage, num_micro_batches)
        * (sum(per_layer if i in moe_layers else per_dense for i in range(starts[stage], starts[stage + 1]))
           + shared + first * (stage == 0) + last * (stage == pp - 1))
        for stage in range(pp)
    )
    if recompute == "full":
        buffer = max(layer_activation_bytes(spec, seq_len, micro_batch, act_bytes, recompute="none", moe=moe,
                                            **layer_kw) for moe in {False, bool(moe_layers)})
    elif recompute == "selective":
        core = [t for t in layer_saved_tensors(spec, seq_len, act_bytes, attention, tp, lora=lora) if t.core_attention]
        buffer = math.ceil(tokens * sum(t.bytes_per_token for t in core))
    else:
        buffer = 0
    return ActivationMemory(per_layer=per_layer, stored=stored, recompute_buffer=buffer)
