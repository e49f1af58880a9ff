"""A model's sampling defaults (`--generation-config`): the sampling settings its generation_config.json
recommends, applied as vLLM applies them, to the requests that do not set them. vLLM's keys: temperature,
top_p, top_k, min_p, repetition_penalty, and max_new_tokens, which becomes the default max_tokens."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass

from engine.sampling_params import RequestError, SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json's key -> SamplingParams' field.
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class SamplingDefaults:
    """None: the file sets nothing for that field, and the API's own default holds."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def as_dict(self) -> dict:
        """The fields the file sets, as SamplingParams keywords."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def params(self, **request) -> SamplingParams:
        """SamplingParams with `request`'s settings, these defaults where it sets none (a None in
        `request` is unset), the API's own beyond them (vLLM's LLM.get_default_sampling_params when
        `request` is empty)."""
        return SamplingParams(**{**self.as_dict(), **{k: v for k, v in request.items() if v is not None}})


def read_sampling_defaults(setting: str, model_folder: str | None) -> SamplingDefaults:
    """`setting` is EngineConfig.generation_config: "auto" reads the model folder's
    generation_config.json (a .gguf file or the embedded model has none), "vllm" reads nothing, any
    other value is a folder holding one. A value SamplingParams refuses is a ValueError naming the file."""
    folder = None if setting == "vllm" else model_folder if setting == "auto" else setting
    path = os.path.join(folder, "generation_config.json") if folder and os.path.isdir(folder) else None
    if path is None or not os.path.isfile(path):
        return SamplingDefaults()
    with open(path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON ({e}): fix it, or pass --generation-config vllm") from None
    defaults = SamplingDefaults(**{field: config[key] for key, field in KEYS.items() if config.get(key) is not None})
    try:
        defaults.params()
    except (RequestError, TypeError) as e:
        raise ValueError(f"{path}: {e}: fix the file, or pass --generation-config vllm to ignore it") from None
    if defaults.as_dict():
        logger.info("the model's sampling defaults (%s): %s (--generation-config vllm ignores them)", path,
                    ", ".join(f"{k}={v}" for k, v in defaults.as_dict().items()))
    return defaults
