"""LLM.generate without sampling_params samples with the model's generation_config.json settings
over the API's defaults (vLLM's LLM.get_default_sampling_params)."""

from __future__ import annotations

import json
import shutil

from engine import LLM, SamplingParams


def test_a_call_without_sampling_params_takes_the_models_defaults(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    with LLM(str(folder), device="cpu", num_kv_blocks=64, max_model_len=128) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=3)
        plain = llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids
        greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert plain == greedy[0].outputs[0].token_ids and len(plain) == 3
