"""Rotary position embedding (half-rotation layout, as in transformers' Llama), with the frequency
scalings of transformers' `rope_type`: `linear`, `llama3`, `yarn`, `dynamic` and `longrope`.

Every type becomes one cos/sin table over the positions the engine serves, computed once, with the
attention factor (YaRN's temperature, LongRoPE's scale) multiplied in as transformers multiplies it
into cos and sin; a decode step only looks rows up. Two types depend on a length in transformers;
here, as in vLLM, they are fixed once, by `max_positions` (the longest sequence the table serves):
- `dynamic` NTK: transformers recomputes the base for each forward's length past
  `max_position_embeddings` (keys already cached keep the old one); here the base is the one for
  `max_positions`, so it is transformers' exactly while `max_positions` stays within
  `max_position_embeddings` (no scaling), and its value for a sequence of `max_positions` beyond
  (vLLM takes the length max_position_embeddings x factor instead).
- `longrope`: transformers takes the short factors while a forward's length is within
  `original_max_position_embeddings` and the long ones past it; here the long factors serve every
  position when `max_positions` exceeds the original length, the short ones otherwise (vLLM's
  rule), so cached keys, and prefix-cache hits, never mix the two.

With a partial rotary factor only the first `rotary_dim` dimensions of each head rotate, in pairs
(i, i + rotary_dim / 2). The kernels rotate pairs (i, i + head_dim / 2) of the whole head, so the
table rotates the first rotary_dim / 2 pairs and leaves the rest (cos 1, sin 0), and the model
loads its q and k rows in `partial_rotary_order`, which puts transformers' pairs there.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "dynamic", "linear", "llama3", "longrope", "yarn")


def rope_settings(hf_config) -> tuple[float, dict]:
    """(theta, scaling) from either transformers 5's `rope_parameters` or 4.x's `rope_theta`/`rope_scaling`.
    `scaling` also carries what the types read beside their own keys, resolved as transformers does:
    `original_max_position_embeddings` (a config-level value first, as Phi-3 stores it),
    `max_position_embeddings` and `partial_rotary_factor`."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    scaling = {**legacy, **params}
    theta = scaling.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    scaling["rope_type"] = rope_type
    max_len = getattr(hf_config, "max_position_embeddings", None)
    scaling["max_position_embeddings"] = max_len
    original = getattr(hf_config, "original_max_position_embeddings", None)
    scaling["original_max_position_embeddings"] = original or scaling.get("original_max_position_embeddings") or max_len
    partial = scaling.get("partial_rotary_factor") or getattr(hf_config, "partial_rotary_factor", None) or 1.0
    scaling["partial_rotary_factor"] = float(partial)
    return float(theta), scaling


def rotary_dim(head_dim: int, scaling: dict) -> int:
    """How many leading dimensions of each head rotate (transformers' int(head_dim * factor))."""
    return int(head_dim * scaling.get("partial_rotary_factor", 1.0))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(base: torch.Tensor, dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): interpolate the low frequencies by `factor`, keep the high ones,
    ramp between the dimensions that turn beta_slow and beta_fast times over the original length."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else _yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 where the frequency is kept (extrapolated), 0 where it is divided by factor
    return base / factor * (1 - keep) + base * keep, float(attention)


def inverse_frequencies(head_dim: int, theta: float, scaling: dict,
                        max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequency of each rotated pair [rotary_dim / 2], attention factor multiplied into
    cos and sin) for this scaling; `max_positions` fixes the length-dependent types (module doc)."""
    dim = rotary_dim(head_dim, scaling)
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    inv_freq = 1.0 / (theta ** exponents)
    kind = scaling["rope_type"]
    attention = 1.0
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate between.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind == "yarn":
        inv_freq, attention = _yarn(inv_freq, dim, theta, scaling)
    elif kind == "dynamic":
        # NTK-aware: a larger base for a length past the trained one (transformers' own formula).
        trained = scaling["max_position_embeddings"]
        length = max(max_positions or trained, trained)
        factor = scaling["factor"]
        base = theta * ((factor * length / trained) - (factor - 1)) ** (dim / (dim - 2))
        inv_freq = 1.0 / (base ** exponents)
    elif kind == "longrope":
        original = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
        attention = scaling.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        long = max_positions is not None and max_positions > original
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float64)
        inv_freq = inv_freq / ext
    return inv_freq, float(attention)


def partial_rotary_order(head_dim: int, rotary: int) -> torch.Tensor:
    """The order to load a head's q/k rows in so that the kernels' pairs (i, i + head_dim / 2) are
    transformers' rotated pairs (i, i + rotary / 2) for i < rotary / 2, and pass-through dimensions
    after: [first half of the rotated | first half of the rest | second half of each]."""
    half, rest = rotary // 2, (head_dim - rotary) // 2
    return torch.cat([torch.arange(half), rotary + torch.arange(rest),
                      half + torch.arange(half), rotary + rest + torch.arange(rest)])


class RotaryEmbedding(nn.Module):
    """One table for the whole model: cos/sin are looked up once per step and shared by all layers."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict):
        super().__init__()
        inv_freq, attention = inverse_frequencies(head_dim, theta, scaling, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)  # [P, rotary_dim/2]
        cos, sin = freqs.cos() * attention, freqs.sin() * attention
        if (unrotated := head_dim // 2 - inv_freq.numel()) > 0:  # partial rotary: the rest pass through
            cos = torch.cat([cos, cos.new_ones(max_positions, unrotated)], dim=1)
            sin = torch.cat([sin, sin.new_zeros(max_positions, unrotated)], dim=1)
        self.register_buffer("cos", cos.float(), persistent=False)
        self.register_buffer("sin", sin.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions in the model's dtype (as transformers applies them):
        [T, 1, head_dim/2], broadcast over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)
