"""A model the engine does not serve is refused in one line that names what (the model_type, or the
config feature), before anything loads; every served family's own config passes."""

from __future__ import annotations

import json
import shutil

import pytest

from engine.loading.loader import resolve_model
from engine.models.registry import MODEL_REGISTRY
from engine.models.support import UnsupportedModelError, check_supported

SERVED = ", ".join(sorted(MODEL_REGISTRY))
# Qwen2-VL's multimodal rope (its config.json), which no text family here computes.
MROPE = {"type": "mrope", "mrope_section": [16, 24, 24]}


@pytest.mark.parametrize("model_type", sorted(MODEL_REGISTRY))
def test_every_served_family_default_config_passes(model_type):
    from transformers import AutoConfig

    check_supported(AutoConfig.for_model(model_type).to_dict())


@pytest.mark.parametrize("config, says", [
    # deepseek-ai/DeepSeek-V3's config.json (multi-head latent attention)
    ({"model_type": "deepseek_v3", "kv_lora_rank": 512, "q_lora_rank": 1536},
     f"model_type 'deepseek_v3' is not supported; the served families are {SERVED}"),
    ({"model_type": "mamba"}, "model_type 'mamba' is not supported"),
    ({}, "model_type None is not supported"),
    ({"model_type": "qwen2", "rope_scaling": MROPE}, "model_type 'qwen2' with rope_scaling of type 'mrope' (served: "),
    ({"model_type": "qwen3", "rope_parameters": {"rope_type": "mrope", "rope_theta": 1e6}},
     "rope_scaling of type 'mrope'"),
    ({"model_type": "llama", "attn_logit_softcapping": 50.0},
     "model_type 'llama' with attention-logit soft-capping (attn_logit_softcapping 50.0) is not implemented here, "
     "and serving it without would give wrong answers"),
    ({"model_type": "llama", "final_logit_softcapping": 30.0},
     "final-logit soft-capping (final_logit_softcapping 30.0)"),
    ({"model_type": "llama", "partial_rotary_factor": 0.5}, "partial rotary embeddings (partial_rotary_factor 0.5)"),
    ({"model_type": "mistral", "sliding_window": [4096, None]},
     "a sliding window per layer (sliding_window [4096, None])"),
])
def test_what_is_not_served_is_one_line_naming_it(config, says):
    with pytest.raises(UnsupportedModelError) as e:
        check_supported(config)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("config", [
    {"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    {"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}},
    {"model_type": "mistral", "sliding_window": 4096},  # one window: the context is capped at it
    {"model_type": "llama", "attn_logit_softcapping": None, "partial_rotary_factor": 1.0},
])
def test_what_is_served_passes(config):
    check_supported(config)


def _with_config(tmp_path, source: str, **changes) -> str:
    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    with open(folder / "config.json") as f:
        config = json.load(f)
    with open(folder / "config.json", "w") as f:
        json.dump({k: v for k, v in {**config, **changes}.items() if v is not None}, f)
    return str(folder)


@pytest.mark.parametrize("rope", [dict(rope_parameters={**MROPE, "rope_theta": 1e4}),
                                  dict(rope_parameters=None, rope_scaling=MROPE)],
                         ids=["transformers-5", "transformers-4"])
def test_a_folder_is_refused_when_it_is_opened(tmp_path, tiny_model_dir, rope):
    folder = _with_config(tmp_path, tiny_model_dir, **rope)
    with pytest.raises(UnsupportedModelError, match="rope_scaling of type 'mrope'"):
        resolve_model(folder)


def test_trust_remote_code_refuses_a_model_class_mapped_to_checkpoint_code(tmp_path, tiny_model_dir):
    auto_map = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    folder = _with_config(tmp_path, tiny_model_dir, auto_map=auto_map)
    with pytest.raises(UnsupportedModelError, match=r"--trust-remote-code: .*'s config.json maps AutoModelForCausalLM "
                                                    r"to its own code \(modeling_x.XForCausalLM\), which the engine "
                                                    r"never runs: drop --trust-remote-code to serve it with the "
                                                    r"engine's own 'llama' implementation"):
        resolve_model(folder, trust_remote_code=True)
    assert resolve_model(folder).hf_config.model_type == "llama"  # without the flag: the engine's own Llama


def test_a_gguf_file_is_checked_when_it_is_opened(tmp_path, monkeypatch, tiny_model_dir):
    """The check reads a .gguf file's config as it reads a folder's (a rule made to refuse this file)."""
    from engine.models import support
    from tests.test_gguf_loader import _tiny_model, _write_gguf

    path = tmp_path / "tiny.gguf"
    _write_gguf(path, _tiny_model("llama"), "llama")
    assert resolve_model(str(path), tokenizer_path=tiny_model_dir).hf_config.vocab_size == 96
    rule = (lambda c: "a vocabulary of 96", lambda c: c.get("vocab_size") == 96, ())
    monkeypatch.setattr(support, "FEATURES", [*support.FEATURES, rule])
    with pytest.raises(UnsupportedModelError, match="model_type 'llama' with a vocabulary of 96 is not implemented"):
        resolve_model(str(path), tokenizer_path=tiny_model_dir)
