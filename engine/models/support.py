"""What the engine serves, checked on a model's config before anything loads: an architecture it has
no implementation of, or a config feature its implementation does not compute, is refused in one line
naming it, never served as a silent wrong answer."""

from __future__ import annotations

from engine.layers.rotary import SUPPORTED_ROPE_TYPES
from engine.models.registry import MODEL_REGISTRY, TEXT_CONFIG_TYPES


class UnsupportedModelError(ValueError):
    """A model the engine does not serve; the message names what and lists what is served."""


def _rope_scaling(config: dict) -> dict:
    return {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}


def _rope_type(config: dict) -> str:
    """The config's rope type, or the first unserved one of its per-layer-type sets (Gemma 3 keeps one
    for its window layers and one for its full layers in rope_parameters)."""
    scaling = _rope_scaling(config)
    kinds = [s.get("rope_type", s.get("type", "default")) or "default"
             for s in [scaling] + [v for v in scaling.values() if isinstance(v, dict)]]
    kind = next((k for k in kinds if k not in SUPPORTED_ROPE_TYPES), kinds[0])
    # Phi-3's older configs name LongRoPE "su" (or "yarn"); transformers' Phi3Config reads them as longrope.
    return "longrope" if config.get("model_type") == "phi3" and kind in ("su", "yarn") else kind


def _set(config: dict, key: str) -> bool:
    return config.get(key) is not None


def _partial_rotary(config: dict):
    """The partial rotary factor, top-level or (as transformers 5 saves it) in rope_parameters."""
    return config.get("partial_rotary_factor") or _rope_scaling(config).get("partial_rotary_factor")


SERVED_LAYER_TYPES = {"full_attention", "sliding_attention"}

# (what a config asks for, in the field's words; whether this config asks for it; the model types
# whose implementation computes it). A family that implements one adds its model_type there.
FEATURES = [
    (lambda c: f"rope_scaling of type {_rope_type(c)!r} (served: {', '.join(SUPPORTED_ROPE_TYPES)})",
     lambda c: _rope_type(c) not in SUPPORTED_ROPE_TYPES, ()),
    # Gemma 3's attention in transformers ignores attn_logit_softcapping: a Gemma 3 config setting it is refused.
    (lambda c: f"attention-logit soft-capping (attn_logit_softcapping {c['attn_logit_softcapping']})",
     lambda c: _set(c, "attn_logit_softcapping"), ("gemma2",)),
    (lambda c: f"final-logit soft-capping (final_logit_softcapping {c['final_logit_softcapping']})",
     lambda c: _set(c, "final_logit_softcapping"), ("gemma2", "gemma3_text")),
    (lambda c: f"partial rotary embeddings (partial_rotary_factor {_partial_rotary(c)})",
     lambda c: _partial_rotary(c) not in (None, 1, 1.0), ("phi3",)),
    # One window size for all layers is served (the context is capped at it); a list is a window per layer.
    (lambda c: f"a sliding window per layer (sliding_window {c['sliding_window']})",
     lambda c: isinstance(c.get("sliding_window"), (list, tuple)), ()),
    (lambda c: f"layer types {sorted(set(c['layer_types']) - SERVED_LAYER_TYPES)} (served: full and sliding attention)",
     lambda c: bool(set(c.get("layer_types") or ()) - SERVED_LAYER_TYPES), ()),
    (lambda c: "bidirectional attention (use_bidirectional_attention)",
     lambda c: bool(c.get("use_bidirectional_attention")), ()),
]


def check_supported(config: dict) -> None:
    """Raise UnsupportedModelError unless the engine serves this config.json (a dict) as it is; a
    TEXT_CONFIG_TYPES model is checked by its text_config, which is what is served."""
    if config.get("model_type") in TEXT_CONFIG_TYPES:
        config = {"model_type": TEXT_CONFIG_TYPES[config["model_type"]], **(config.get("text_config") or {})}
    model_type = config.get("model_type")
    if model_type not in MODEL_REGISTRY:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported; the served families are "
                                    f"{', '.join(sorted(MODEL_REGISTRY))}")
    for describe, asks, served_by in FEATURES:
        if asks(config) and model_type not in served_by:
            raise UnsupportedModelError(f"model_type {model_type!r} with {describe(config)} is not implemented "
                                        "here, and serving it without would give wrong answers")
