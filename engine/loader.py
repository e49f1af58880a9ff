"""Find a model's config, tokenizer and weights, and load the weights into a model.

A model is a Hugging Face folder (config.json + *.safetensors, single or sharded) or a .gguf
file. Each parameter's own `weight_loader` copies its shard, so this file knows nothing about
tensor parallelism.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)


@dataclass
class ModelSource:
    path: str  # folder or .gguf file
    name: str  # what the server reports as the model id
    hf_config: object
    tokenizer: object
    eos_token_ids: list[int] = field(default_factory=list)

    @property
    def is_gguf(self) -> bool:
        return self.path.endswith(".gguf")


def resolve_model(path: str | None, tokenizer_path: str | None = None) -> ModelSource:
    """Open a model folder, a .gguf file, or (path None) the embedded default model."""
    if path is None:
        from engine.default_model import DEFAULT_MODEL_NAME, default_model_path

        source = resolve_model(default_model_path(), tokenizer_path)
        source.name = DEFAULT_MODEL_NAME
        return source
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist")
    name = os.path.basename(os.path.normpath(path))
    if path.endswith(".gguf"):
        from engine.gguf_loader import load_gguf

        gguf = load_gguf(path)
        tokenizer = gguf.tokenizer if tokenizer_path is None else _load_tokenizer(tokenizer_path)
        return ModelSource(path, name, gguf.config, tokenizer, _eos_ids(tokenizer, gguf.config, None))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path!r} has no config.json: pass a Hugging Face model folder or a .gguf file")
    from transformers import AutoConfig

    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    from engine.models.registry import model_class

    model_class(model_type)  # fail early, naming the supported types
    hf_config = AutoConfig.from_pretrained(path)
    tokenizer = _load_tokenizer(tokenizer_path or path)
    return ModelSource(path, name, hf_config, tokenizer, _eos_ids(tokenizer, hf_config, path))


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _eos_ids(tokenizer, hf_config, folder: str | None) -> list[int]:
    """EOS ids from the tokenizer, config.json and generation_config.json (each may be a list)."""
    ids: list[int] = []

    def add(value):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(v, int) and v not in ids:
                ids.append(v)

    add(getattr(tokenizer, "eos_token_id", None))
    add(getattr(hf_config, "eos_token_id", None))
    if folder and os.path.isfile(os.path.join(folder, "generation_config.json")):
        with open(os.path.join(folder, "generation_config.json")) as f:
            add(json.load(f).get("eos_token_id"))
    return ids


def checkpoint_tensors(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    if source.is_gguf:
        from engine.gguf_loader import load_gguf

        yield from load_gguf(source.path).tensors()
        return
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(source.path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {source.path!r}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: torch.nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Route each checkpoint tensor to its parameter's weight_loader; every parameter must be filled."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules", {})
    missing = set(params)
    for name, tensor in tensors:
        if "rotary_emb" in name or (name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False)):
            continue
        target, shard_id = name, None
        for ckpt_part, (param_part, shard) in packed.items():
            if f".{ckpt_part}." in name:
                target, shard_id = name.replace(f".{ckpt_part}.", f".{param_part}."), shard
                break
        tied = getattr(model, "tie_word_embeddings", False)
        if name == "model.embed_tokens.weight" and tied and "lm_head.weight" in params:
            target = "lm_head.weight"  # a last pipeline stage's own copy of the tied matrix (it has no embeddings)
        param = params.get(target)
        if param is None:
            continue  # another pipeline stage's layer, or a tensor this model does not use
        loader = param.weight_loader if hasattr(param, "weight_loader") else _copy
        tensor = tensor.to(param.dtype)
        loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
        missing.discard(target)
    if missing:
        raise ValueError(f"checkpoint has no tensors for parameters: {sorted(missing)[:8]}")


def _copy(param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
    param.data.copy_(tensor)
