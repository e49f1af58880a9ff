"""Find a model: its config, tokenizer and weights' source (ModelSource), checked before anything
loads. A model is a Hugging Face folder (config.json + *.safetensors, single or sharded) or a .gguf
file, named by its path or by a Hub id (engine/loading/hub.py finds it in the Hugging Face cache);
`quantization` and a folder's config.json say how its weights are to be read
(engine/loading/weights.py reads them into a model).
"""

from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import dataclass, field

from engine.loading import hub
from engine.loading.sampling_defaults import SamplingDefaults, read_sampling_defaults

logger = logging.getLogger(__name__)


@dataclass
class ModelSource:
    path: str  # folder or .gguf file
    name: str  # what the server reports as the model id
    hf_config: object
    tokenizer: object
    eos_token_ids: list[int] = field(default_factory=list)
    gguf_weights: str = "native"  # a .gguf's quantized linear weights: "native" (kept as blocks) | "dequantize"
    quantization: str | None = None  # "int8" | "int4" (at load), or the pre-quantized method read
    quantization_group_size: int = 128  # int4's inputs per group
    quantize_lm_head: bool = False  # at load, the LM head (and a tied embedding) quantized too
    prequantized: object = None  # engine.quant.prequantized.Prequantized: the reader of a pre-quantized folder
    # The model's sampling defaults for requests that do not set them (--generation-config).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    @property
    def is_gguf(self) -> bool:
        return self.path.endswith(".gguf")


class ModelFolderError(ValueError):
    """A model path that cannot be served as it is; the message says what to change."""


def source_for(config) -> ModelSource:
    """resolve_model with an EngineConfig's settings: every process that loads a model (front end,
    data-parallel replica, worker rank, torchrun rank) opens it the same way. A Hub id is read from
    the Hugging Face cache (the first process to need it downloads it) and keeps its id as the name."""
    path = hub.model_path(config)
    source = resolve_model(path, hub.tokenizer_path(config), config.chat_template, config.gguf_weights,
                           config.quantization, config.quantization_group_size, config.quantize_lm_head,
                           config.trust_remote_code)
    if path != config.model:
        source.name = config.model
    source.sampling_defaults = read_sampling_defaults(config.generation_config,
                                                      None if path is None or source.is_gguf else source.path)
    return source


def resolve_model(path: str | None, tokenizer_path: str | None = None,
                  chat_template: str | None = None, gguf_weights: str = "native",
                  quantization: str | None = None, quantization_group_size: int = 128,
                  quantize_lm_head: bool = False, trust_remote_code: bool = False) -> ModelSource:
    """Open a model folder, a .gguf file, or (path None) the embedded default model (its .gguf).

    Checks the folder first (config.json, every safetensors header) so that a bad one fails in
    a second with what to do, not after minutes of loading. `chat_template` (Jinja text or a
    file) replaces the tokenizer's own. `gguf_weights`, `quantization`, `quantize_lm_head`
    (EngineConfig's): see the module docstring; a `quantization` the checkpoint cannot take is a
    ValueError naming the flag. An architecture or config feature the engine does not implement is an
    UnsupportedModelError naming it, as is `trust_remote_code` for a model whose config.json points
    its model class at its own code."""
    if path is None:
        from engine.loading.default_model import DEFAULT_MODEL_NAME, default_gguf_path, default_model_path

        # The file as shipped: its Q4_1 blocks stay resident (92 MiB, not the float folder's 621)
        # and run the block kernels. --quantization quantizes float weights, so it takes the float
        # folder converted from the same file.
        default = default_model_path() if quantization else default_gguf_path()
        source = resolve_model(default, tokenizer_path, chat_template, gguf_weights,
                               quantization=quantization, quantization_group_size=quantization_group_size,
                               quantize_lm_head=quantize_lm_head)
        source.name = DEFAULT_MODEL_NAME
        return source
    if not os.path.exists(path):
        raise ModelFolderError(f"model path {path!r} does not exist")
    name = os.path.basename(os.path.normpath(path))
    if path.endswith(".gguf"):
        from engine.loading.gguf_loader import load_gguf

        check_gguf_file(path)
        gguf = load_gguf(path, with_tokenizer=tokenizer_path is None)  # --tokenizer: not converted for nothing
        from engine.models.support import check_supported

        check_supported(gguf.config.to_dict())
        _check_gguf_quantization(path, quantization, gguf.types())
        tokenizer = gguf.tokenizer if tokenizer_path is None else _load_tokenizer(tokenizer_path)
        _set_chat_template(tokenizer, chat_template)
        return ModelSource(path, name, gguf.config, tokenizer, _eos_ids(tokenizer, gguf.config, None), gguf_weights,
                           quantization, quantization_group_size, quantize_lm_head=quantize_lm_head)
    check_model_folder(path)
    from transformers import AutoConfig

    with open(os.path.join(path, "config.json")) as f:
        config_json = json.load(f)
    from engine.models.registry import TEXT_CONFIG_TYPES
    from engine.models.support import check_supported

    if trust_remote_code:
        _check_remote_code(path, config_json)
    check_supported(config_json)  # fail early, naming what is served
    prequantized = _check_folder_quantization(path, quantization, config_json)
    hf_config = AutoConfig.from_pretrained(path)
    if config_json.get("model_type") in TEXT_CONFIG_TYPES:
        hf_config = hf_config.get_text_config()  # its language model is what is served
    tokenizer = _load_tokenizer(tokenizer_path or path)
    _set_chat_template(tokenizer, chat_template)
    method = prequantized.method if prequantized is not None else quantization
    return ModelSource(path, name, hf_config, tokenizer, _eos_ids(tokenizer, hf_config, path),
                       quantization=method, quantization_group_size=quantization_group_size,
                       quantize_lm_head=quantize_lm_head, prequantized=prequantized)


def stored_dtype(path: str) -> str | None:
    """The dtype a model folder's config.json records for its weights (a .gguf's: see gguf_loader),
    None when it records none; what dtype "auto" goes by on a CPU (engine.runner.model_runner.resolve_dtype)."""
    if path.endswith(".gguf"):
        from engine.loading.gguf_header import open_gguf
        from engine.loading.gguf_loader import stored_dtype as gguf_stored_dtype

        return gguf_stored_dtype(open_gguf(path))  # the tensor table alone, no config built
    with open(os.path.join(path, "config.json")) as f:
        config_json = json.load(f)
    return config_json.get("dtype") or config_json.get("torch_dtype")


def _check_remote_code(path: str, config_json: dict) -> None:
    """--trust-remote-code asks for a checkpoint's own model code, which the engine never runs."""
    from engine.models.registry import MODEL_REGISTRY
    from engine.models.support import UnsupportedModelError

    auto_map = config_json.get("auto_map") or {}
    key = next((k for k in auto_map if k.startswith("AutoModel")), None)
    if key is None:
        return
    model_type = config_json.get("model_type")
    instead = (f"drop --trust-remote-code to serve it with the engine's own {model_type!r} implementation"
               if model_type in MODEL_REGISTRY else f"the served families are {', '.join(sorted(MODEL_REGISTRY))}")
    raise UnsupportedModelError(f"--trust-remote-code: {path}'s config.json maps {key} to its own code "
                                f"({auto_map[key]}), which the engine never runs: {instead}")


def _check_gguf_quantization(path: str, quantization: str | None, types: dict[str, tuple[str, str]]) -> None:
    """--quantization on a GGUF file: int8 / int4 quantize a float one; a quantized one is served as
    stored, and the pre-quantized methods read safetensors folders."""
    from engine.quant import FLOAT_TYPES
    from engine.quant.prequantized import METHODS

    if quantization is None:
        return
    if quantization in METHODS:
        raise ValueError(f"--quantization {quantization} reads pre-quantized safetensors folders; {path} is a GGUF "
                         "file (its quantized tensors are served as stored): drop --quantization")
    kinds = sorted({kind for _, kind in types.values() if kind not in FLOAT_TYPES})
    if kinds:
        raise ValueError(f"--quantization {quantization}: {path} is already quantized (GGUF {', '.join(kinds)} "
                         "tensors), and quantizing it again would only lose more: drop --quantization")


def _check_folder_quantization(path: str, quantization: str | None, config_json: dict):
    """The pre-quantized reader config.json asks for (None for a float checkpoint), checked against
    --quantization."""
    from engine.quant.prequantized import read_quantization_config
    from engine.quant.quantize import AT_LOAD_METHODS

    reader = read_quantization_config(config_json)
    if reader is not None and quantization in AT_LOAD_METHODS:
        raise ValueError(f"--quantization {quantization}: {path} is already quantized ({reader.method}, says its "
                         f"config.json), and is read as such: drop --quantization")
    if quantization not in (None, *AT_LOAD_METHODS):
        if reader is None:
            raise ValueError(f"--quantization {quantization}: {path} is not a pre-quantized checkpoint (its "
                             "config.json has no quantization_config): drop the flag, or quantize it at load "
                             "with --quantization int8, int4 or fp8")
        if reader.method != quantization:
            raise ValueError(f"--quantization {quantization}: {path} is a {reader.method} checkpoint (says its "
                             f"config.json): drop the flag (the method is detected) or pass {reader.method}")
    return reader


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

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:  # transformers' words, without the traceback
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"tokenizer: no tokenizer could be loaded from {path!r} ({why}): it needs tokenizer.json "
                         "or tokenizer_config.json with its vocabulary files") from None


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
