"""Find a model's config, tokenizer and weights, and load the weights into a model.

A model is a Hugging Face folder (config.json + *.safetensors, single or sharded) or a .gguf
file. Each parameter's own `weight_loader` copies its shard, so this file knows nothing about
tensor parallelism.

A .gguf file's linear weights stay in their block format (engine/quant) when every checkpoint
tensor of the layer has one type and the format is one engine.quant supports (`gguf_weights`
"native", the default); other quantized tensors (the token embedding, a layer with mixed types)
are dequantized to float as before, with a log line saying which. `gguf_weights="dequantize"`
dequantizes every tensor (the path before engine/quant existed).
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterable, Iterator
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
    gguf_weights: str = "native"  # a .gguf's quantized linear weights: "native" (kept as blocks) | "dequantize"

    @property
    def is_gguf(self) -> bool:
        return self.path.endswith(".gguf")


class ModelFolderError(ValueError):
    """A model path that cannot be served as it is; the message says what to change."""


def resolve_model(path: str | None, tokenizer_path: str | None = None,
                  chat_template: str | None = None, gguf_weights: str = "native") -> ModelSource:
    """Open a model folder, a .gguf file, or (path None) the embedded default model.

    Checks the folder first (config.json, every safetensors header) so that a bad one fails in
    a second with what to do, not after minutes of loading. `chat_template` (Jinja text or a
    file) replaces the tokenizer's own. `gguf_weights`: see the module docstring."""
    if path is None:
        from engine.default_model import DEFAULT_MODEL_NAME, default_model_path

        source = resolve_model(default_model_path(), tokenizer_path, chat_template)
        source.name = DEFAULT_MODEL_NAME
        return source
    if not os.path.exists(path):
        raise ModelFolderError(f"model path {path!r} does not exist")
    name = os.path.basename(os.path.normpath(path))
    if path.endswith(".gguf"):
        from engine.gguf_loader import load_gguf

        check_gguf_file(path)
        gguf = load_gguf(path)
        tokenizer = gguf.tokenizer if tokenizer_path is None else _load_tokenizer(tokenizer_path)
        _set_chat_template(tokenizer, chat_template)
        return ModelSource(path, name, gguf.config, tokenizer, _eos_ids(tokenizer, gguf.config, None), gguf_weights)
    check_model_folder(path)
    from transformers import AutoConfig

    with open(os.path.join(path, "config.json")) as f:
        model_type = json.load(f).get("model_type")
    from engine.models.registry import model_class

    model_class(model_type)  # fail early, naming the supported types
    hf_config = AutoConfig.from_pretrained(path)
    tokenizer = _load_tokenizer(tokenizer_path or path)
    _set_chat_template(tokenizer, chat_template)
    return ModelSource(path, name, hf_config, tokenizer, _eos_ids(tokenizer, hf_config, path))


def check_model_folder(path: str) -> None:
    """Raise ModelFolderError unless `path` is a folder with config.json and readable safetensors."""
    if os.path.isfile(path):
        raise ModelFolderError(f"{path!r} is a file: pass the folder that holds config.json and "
                               "*.safetensors, or a .gguf file")
    if not os.path.isfile(os.path.join(path, "config.json")):
        nested = sorted(glob.glob(os.path.join(path, "*", "config.json")))
        hint = f" (did you mean {os.path.dirname(nested[0])!r}?)" if nested else ""
        raise ModelFolderError(f"{path!r} has no config.json{hint}: pass a Hugging Face model folder "
                               "or a .gguf file")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelFolderError(_no_safetensors_message(path))
    for file in _indexed_shards(path) or files:
        check_safetensors_file(file)


def _no_safetensors_message(path: str) -> str:
    torch_files = [f for pattern in ("*.bin", "*.pt", "*.pth") for f in glob.glob(os.path.join(path, pattern))]
    if not torch_files:
        return f"{path!r} has no *.safetensors weights: pass a folder with the model's safetensors files"
    # The engine reads safetensors only (no pickle: loading a .bin can run code); one re-save converts.
    return (f"{path!r} has PyTorch {os.path.basename(torch_files[0])} weights but no *.safetensors; convert "
            "them once with: python -c \"from transformers import AutoModelForCausalLM as M; "
            f"M.from_pretrained({path!r}).save_pretrained({path!r}, safe_serialization=True)\"")


def _indexed_shards(path: str) -> list[str]:
    """The shard files a sharded checkpoint's index names; a missing one is an error now."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return []
    try:
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, AttributeError) as e:
        raise ModelFolderError(f"{index!r} is not a safetensors index ({e}): re-download it") from None
    missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
    if missing:
        raise ModelFolderError(f"{path!r} lacks {len(missing)} of the {len(names)} shards its index names "
                               f"(first: {missing[0]}): download the missing files")
    return [os.path.join(path, n) for n in names]


def check_safetensors_file(file: str) -> None:
    """Read only the header: a truncated or corrupt file is named, with what is wrong, before any
    weight is loaded. Layout: 8-byte little-endian header length, JSON header, tensor data."""
    size = os.path.getsize(file)
    fix = "re-download or re-save it"
    if size < 8:
        raise ModelFolderError(f"{file}: {size} bytes, too short for a safetensors file: {fix}")
    with open(file, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if 8 + header_len > size:
            raise ModelFolderError(f"{file}: truncated: the header says it is {header_len} bytes but the file "
                                   f"is {size} bytes in all: {fix}")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ModelFolderError(f"{file}: corrupt: its header is not JSON: {fix}") from None
    try:
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, AttributeError):
        raise ModelFolderError(f"{file}: corrupt: its header has no valid data_offsets: {fix}") from None
    if 8 + header_len + end > size:
        raise ModelFolderError(f"{file}: truncated: the tensor data ends at byte {8 + header_len + end} but the "
                               f"file is {size} bytes: {fix}")


def check_gguf_file(file: str) -> None:
    with open(file, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelFolderError(f"{file}: not a GGUF file (it does not start with 'GGUF'): re-download it")


def _set_chat_template(tokenizer, chat_template: str | None) -> None:
    """Replace the tokenizer's chat template with `chat_template` (Jinja text or a file), checked
    for syntax now rather than at the first chat request."""
    if chat_template is None:
        return
    if os.path.isfile(os.path.expanduser(chat_template)):
        with open(os.path.expanduser(chat_template)) as f:
            chat_template = f.read()
    import jinja2

    try:
        jinja2.Environment().parse(chat_template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: Jinja syntax error on line {e.lineno}: {e.message}") from None
    tokenizer.chat_template = chat_template


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


class GGUFTensors:
    """A .gguf file's tensors, iterable like any checkpoint's (name, tensor) pairs, plus what
    load_weights needs to decide first which of them stay quantized: each one's GGUF type, and
    `native`, the names load_weights chose (set before iterating)."""

    def __init__(self, path: str, gguf_weights: str):
        from engine.gguf_loader import load_gguf

        self.path = path
        self.gguf_weights = gguf_weights
        self.model = load_gguf(path)
        self.types = self.model.types()  # HF name -> (GGUF name, GGUF type name)
        self.native: set[str] = set()

    def __iter__(self):
        return self.model.tensors(self.native)


def checkpoint_tensors(source: ModelSource) -> Iterable[tuple[str, object]]:
    if source.is_gguf:
        return GGUFTensors(source.path, source.gguf_weights)
    return _safetensors(source.path)


def _safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path!r}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _target(model: torch.nn.Module, name: str, params: dict) -> str | None:
    """The parameter checkpoint tensor `name` loads into, or None where none here does."""
    tied = getattr(model, "tie_word_embeddings", False)
    if "rotary_emb" in name or (name == "lm_head.weight" and tied):
        return None
    target, _ = model.checkpoint_target(name)
    if name == "model.embed_tokens.weight" and tied and "lm_head.weight" in params:
        target = "lm_head.weight"  # a last pipeline stage's own copy of the tied matrix (it has no embeddings)
    return target if target in params else None


def choose_native_weights(model: torch.nn.Module, tensors: GGUFTensors) -> None:
    """Turn each linear layer whose GGUF tensors all share one supported block format into a
    quantized layer (quantize_weight) and mark those tensors to come as stored. A quantized tensor
    of a type with no format, bound for such a layer, is an error; one bound elsewhere (an
    embedding, a layer whose parts mix types) is dequantized with a log line."""
    from engine.quant import FLOAT_TYPES, FORMATS

    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    parts: dict[str, list[tuple[str, str, str]]] = {}  # target -> [(HF name, GGUF name, type)]
    for name, (gguf_name, kind) in tensors.types.items():
        if (target := _target(model, name, params)) is not None:
            parts.setdefault(target, []).append((name, gguf_name, kind))
    dequantized: list[str] = []
    for target, group in parts.items():
        kinds = {kind for _, _, kind in group}
        if kinds <= set(FLOAT_TYPES):
            continue
        if tensors.gguf_weights == "dequantize":
            dequantized += [f"{g} ({k})" for _, g, k in group if k not in FLOAT_TYPES]
            continue
        module = modules.get(target.rpartition(".")[0])
        holder = target.endswith(".weight") and hasattr(module, "quantize_weight")
        if holder and len(kinds) == 1 and next(iter(kinds)) in FORMATS:
            module.quantize_weight(FORMATS[kinds.pop()])
            tensors.native.update(name for name, _, _ in group)
            continue
        # Still served, as float: never silently (the log line below names each one and why).
        for _, g, k in group:
            if k in FLOAT_TYPES:
                continue
            why = ("no native kernel for it yet" if k not in FORMATS else
                   "its layer mixes types" if holder else "its parameter keeps float weights")
            dequantized.append(f"{g} ({k}, {why})")
    if dequantized:
        how = "as asked (gguf_weights='dequantize')" if tensors.gguf_weights == "dequantize" else "not natively"
        more = f", ... ({len(dequantized) - 4} more)" if len(dequantized) > 4 else ""
        native_note = f"; kept as stored: {', '.join(FORMATS)}" if tensors.gguf_weights == "native" else ""
        logger.warning("GGUF: %d quantized tensor(s) dequantized to float, %s: %s%s", len(dequantized), how,
                       ", ".join(dequantized[:4]) + more, native_note)


def load_weights(model: torch.nn.Module, tensors: Iterable[tuple[str, object]]) -> None:
    """Route each checkpoint tensor to its parameter's weight_loader; every parameter must be filled."""
    if isinstance(tensors, GGUFTensors):
        choose_native_weights(model, tensors)
    params = dict(model.named_parameters())
    missing = set(params)
    for name, tensor in tensors:
        if (target := _target(model, name, params)) is None:
            continue  # another pipeline stage's layer, or a tensor this model does not use
        _, shard_id = model.checkpoint_target(name)
        param = params[target]
        loader = param.weight_loader if hasattr(param, "weight_loader") else _copy
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.to(param.dtype)
        loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
        missing.discard(target)
    if missing:
        raise ValueError(f"checkpoint has no tensors for parameters: {sorted(missing)[:8]}")


def _copy(param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
    param.data.copy_(tensor)
