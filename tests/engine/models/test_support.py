"""A model the engine does not serve is refused in one line that names what (the model_type, or the
config feature), before anything loads; every served family's own config passes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.loading.loader import resolve_model
from engine.models.registry import MODEL_REGISTRY
from engine.models.support import UnsupportedModelError, check_supported

SERVED = "llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe"
# Qwen3's model card ("Processing Long Texts"): YaRN to 131,072 tokens from a native 32,768.
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
YARN = {**QWEN3_YARN, "rope_theta": 10000.0}  # as transformers 5 writes it (rope_parameters)


@pytest.mark.parametrize("model_type", sorted(MODEL_REGISTRY))
def test_every_served_family_default_config_passes(model_type):
    from transformers import AutoConfig

    check_supported(AutoConfig.for_model(model_type).to_dict())


@pytest.mark.parametrize("config, says", [
    # google/gemma-2-2b's config.json (the fields that matter here)
    ({"model_type": "gemma2", "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
     f"model_type 'gemma2' is not supported; the served families are {SERVED}"),
    ({"model_type": "gpt_oss"}, "model_type 'gpt_oss' is not supported"),
    ({"model_type": "phi3"}, "model_type 'phi3' is not supported"),
    ({}, "model_type None is not supported"),
    ({"model_type": "qwen3", "rope_scaling": QWEN3_YARN},
     "model_type 'qwen3' with rope_scaling of type 'yarn' (served: default, llama3, linear) is not implemented here"),
    ({"model_type": "llama", "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling of type 'dynamic'"),
    ({"model_type": "qwen2", "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0],
                                                 "long_factor": [2.0]}}, "rope_scaling of type 'longrope'"),
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


def test_yarn_changes_what_transformers_computes(tiny_model_dir):
    """Why a rope type is refused rather than read as plain rope: transformers' logits with YaRN differ."""
    from transformers import AutoConfig, AutoModelForCausalLM

    yarn = {**YARN, "original_max_position_embeddings": 128}
    ids = torch.tensor([[5, 17, 42, 99, 7, 250]])
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir)(ids).logits
        config = AutoConfig.from_pretrained(tiny_model_dir, rope_parameters=yarn)
        scaled = AutoModelForCausalLM.from_pretrained(tiny_model_dir, config=config)(ids).logits
    assert (plain - scaled).abs().max() > 1e-3


def _with_config(tmp_path, source: str, **changes) -> str:
    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    with open(folder / "config.json") as f:
        config = json.load(f)
    with open(folder / "config.json", "w") as f:
        json.dump({k: v for k, v in {**config, **changes}.items() if v is not None}, f)
    return str(folder)


@pytest.mark.parametrize("rope", [dict(rope_parameters=YARN), dict(rope_parameters=None, rope_scaling=QWEN3_YARN)],
                         ids=["transformers-5", "transformers-4"])
def test_a_folder_is_refused_when_it_is_opened(tmp_path, tiny_model_dir, rope):
    folder = _with_config(tmp_path, tiny_model_dir, **rope)
    with pytest.raises(UnsupportedModelError, match="rope_scaling of type 'yarn'"):
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


def test_a_gguf_file_with_yarn_is_refused_when_it_is_opened(tmp_path, monkeypatch, tiny_model_dir):
    """llama.cpp's converter writes YaRN as rope.scaling.type; the file is refused as the folder is."""
    import gguf

    from tests.test_gguf_loader import _tiny_model, _write_gguf

    class YarnWriter(gguf.GGUFWriter):
        def add_rope_freq_base(self, value: float) -> None:
            super().add_rope_freq_base(value)
            self.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            self.add_rope_scaling_factor(4.0)

    monkeypatch.setattr(gguf, "GGUFWriter", YarnWriter)
    path = tmp_path / "yarn.gguf"
    _write_gguf(path, _tiny_model("llama"), "llama")
    with pytest.raises(UnsupportedModelError, match="model_type 'llama' with rope_scaling of type 'yarn'"):
        resolve_model(str(path), tokenizer_path=tiny_model_dir)
