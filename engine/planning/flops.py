"""Training FLOPs: the 6ND rule, 8ND with full recomputation, and the exact per-layer count.

For a mixture-of-experts model N is the active parameter count (each token runs top-k experts), as
Mixtral's "12.9B active of 46.7B" and the Switch Transformer's FLOPs-matched comparisons count it
(Fedus et al. 2022, §2).
"""

from __future__ import annotations

from engine.planning.spec import ModelSpec

FLOPS_METHODS = ("nd", "exact")


def nd_flops(params: int, tokens: int, recompute: str = "none") -> float:
    """C = 6ND (Kaplan et al. 2020, §2.1: 2ND forward, 4ND backward). Full recomputation runs the
    forward twice: 8ND (Narayanan et al. 2021, §5.1; Korthikanti et al. 2022, §4.1)."""
    return float((8 if recompute == "full" else 6) * params * tokens)


def matmul_params(spec: ModelSpec) -> int:
    """Weights one token multiplies by in all layers: q, k, v, o projections and the MLP matrices; in an
    MoE layer the router, the shared expert and the top-k routed experts (not the idle ones)."""
    h = spec.hidden_size
    attention = h * (2 * spec.q_size + 2 * spec.kv_size)
    dense = (3 if spec.mlp == "swiglu" else 2) * h * spec.ffn_hidden_size
    moe = (spec.num_experts * h + spec.experts_per_token * spec.expert_params
           + 3 * h * spec.shared_expert_ffn_size + h * (spec.shared_expert_ffn_size > 0))
    moe_layers = len(spec.moe_layers)
    return spec.num_layers * attention + (spec.num_layers - moe_layers) * dense + moe_layers * moe


def forward_flops_per_token(spec: ModelSpec, seq_len: int) -> tuple[int, int, int]:
    """(layer matmuls, attention scores, LM head) forward FLOPs of one token, all layers.

    A matmul costs 2 FLOPs per weight; QK^T and AV cost 2 x s x q_size each, counted over the full
    s x s matrix as Narayanan et al. 2021 (eq. 3) do. Norms, softmax and activations are omitted.
    """
    layers = 2 * matmul_params(spec)
    attention = spec.num_layers * 4 * seq_len * spec.q_size
    head = 2 * spec.hidden_size * spec.vocab_size
    return layers, attention, head


def exact_flops(spec: ModelSpec, seq_len: int, tokens: int, recompute: str = "none") -> float:
    """Forward + backward (twice the forward: gradients for inputs and for weights) + what is recomputed:
    every layer's forward with full recomputation, only the attention scores with selective
    (Korthikanti et al. 2022, §4.3). For GPT with full recomputation this is Narayanan et al.'s
    96 B s l h^2 (1 + s/6h + V/16lh)."""
    layers, attention, head = forward_flops_per_token(spec, seq_len)
    per_token = 3 * (layers + attention + head)
    if recompute == "full":
        per_token += layers + attention
    elif recompute == "selective":
        per_token += attention
    return float(per_token) * tokens


def training_flops(spec: ModelSpec, seq_len: int, tokens: int, method: str, recompute: str,
                   adapter_params: int | None = None) -> tuple[float, float]:
    """(FLOPs executed, model FLOPs): the second leaves recomputation out, as MFU requires
    (Chowdhery et al. 2022, PaLM, Appendix B).

    With `adapter_params` (LoRA) the frozen weights get no weight gradient: the backward costs one forward
    for them (the gradients of their inputs) and two for the adapters, so 4N + 6N_adapters per token in
    place of 6N (Hu et al. 2021, §4.2: training is faster as most parameters need no gradient)."""
    if method not in FLOPS_METHODS:
        raise ValueError(f"flops method must be one of {FLOPS_METHODS}, got {method!r}")
    if adapter_params is not None:
        return (_lora_flops(spec, seq_len, tokens, method, recompute, adapter_params),
                _lora_flops(spec, seq_len, tokens, method, "none", adapter_params))
    if method == "nd":
        # 6ND counts the parameters a token passes through: the active ones of an MoE model
        return nd_flops(spec.active_params, tokens, recompute), nd_flops(spec.active_params, tokens)
    return exact_flops(spec, seq_len, tokens, recompute), exact_flops(spec, seq_len, tokens)


def _lora_flops(spec: ModelSpec, seq_len: int, tokens: int, method: str, recompute: str, adapters: int) -> float:
    if method == "nd":
        per_token = 4 * spec.active_params + (2 * spec.active_params if recompute == "full" else 0)
        return float(per_token * tokens + nd_flops(adapters, tokens, recompute))
    layers, attention, head = forward_flops_per_token(spec, seq_len)
    # attention scores have no weights: their backward costs two forwards, as in full fine-tuning
    per_token = 2 * (layers + head) + 3 * attention + 6 * adapters
    if recompute == "full":
        per_token += layers + attention + 2 * adapters
    elif recompute == "selective":
        per_token += attention
    return float(per_token) * tokens
