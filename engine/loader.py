"""Find a model's config, tokenizer and weights, and load the weights into a model.

A model is a Hugging Face folder (config.json + *.safetensors, single or sharded) or a .gguf
file. Each parameter's own `weight_loader` copies its shard, so this file knows nothing about
tensor parallelism.

A .gguf file's linear weights stay in their block format (engine/quant) when every checkpoint
tensor of the layer has one type and the format is one engine.quant supports (`gguf_weights`
"native", the default); other quantized tensors (the token embedding, a layer with mixed types)
are dequantized to float as before, with a log line saying which. `gguf_weights="dequantize"`
dequantizes every tensor (the path before engine/quant existed).

A float checkpoint's linear weights (a safetensors folder's, or a float GGUF's) are quantized at
load with `quantization` "int8" / "int4" (engine/quant/quantize.py); those of a safetensors folder
whose config.json names a pre-quantized method (GPTQ, AWQ, compressed-tensors) are converted from
its layout (engine/quant/prequantized.py); either way into GGUF's block formats, served by the
same kernels. The embeddings and the LM head keep float
weights (as in vLLM), as do layers without a quantized kernel (MoE experts), with a log line naming
them; a quantized checkpoint tensor bound for such a parameter is dequantized, with a log line.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from engine.safetensors_slices import SafetensorsSlice

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
    prequantized: object = None  # engine.quant.prequantized.Prequantized: the reader of a pre-quantized folder

    @property
    def is_gguf(self) -> bool:
        return self.path.endswith(".gguf")


class ModelFolderError(ValueError):
    """A model path that cannot be served as it is; the message says what to change."""


def source_for(config) -> ModelSource:
    """resolve_model with an EngineConfig's settings: every process that loads a model (front end,
    data-parallel replica, worker rank, torchrun rank) opens it the same way."""
    return resolve_model(config.model, config.tokenizer, config.chat_template, config.gguf_weights,
                         config.quantization, config.quantization_group_size)


def resolve_model(path: str | None, tokenizer_path: str | None = None,
                  chat_template: str | None = None, gguf_weights: str = "native",
                  quantization: str | None = None, quantization_group_size: int = 128) -> ModelSource:
    """Open a model folder, a .gguf file, or (path None) the embedded default model.

    Checks the folder first (config.json, every safetensors header) so that a bad one fails in
    a second with what to do, not after minutes of loading. `chat_template` (Jinja text or a
    file) replaces the tokenizer's own. `gguf_weights`, `quantization` (EngineConfig's): see the
    module docstring; a `quantization` the checkpoint cannot take is a ValueError naming the flag."""
    if path is None:
        from engine.default_model import DEFAULT_MODEL_NAME, default_model_path

        source = resolve_model(default_model_path(), tokenizer_path, chat_template,
                               quantization=quantization, quantization_group_size=quantization_group_size)
        source.name = DEFAULT_MODEL_NAME
        return source
    if not os.path.exists(path):
        raise ModelFolderError(f"model path {path!r} does not exist")
    name = os.path.basename(os.path.normpath(path))
    if path.endswith(".gguf"):
        from engine.gguf_loader import load_gguf

        check_gguf_file(path)
        gguf = load_gguf(path)
        _check_gguf_quantization(path, quantization, gguf.types())
        tokenizer = gguf.tokenizer if tokenizer_path is None else _load_tokenizer(tokenizer_path)
        _set_chat_template(tokenizer, chat_template)
        return ModelSource(path, name, gguf.config, tokenizer, _eos_ids(tokenizer, gguf.config, None), gguf_weights,
                           quantization, quantization_group_size)
    check_model_folder(path)
    from transformers import AutoConfig

    with open(os.path.join(path, "config.json")) as f:
        config_json = json.load(f)
    from engine.models.registry import model_class

    model_class(config_json.get("model_type"))  # fail early, naming the supported types
    prequantized = _check_folder_quantization(path, quantization, config_json)
    hf_config = AutoConfig.from_pretrained(path)
    tokenizer = _load_tokenizer(tokenizer_path or path)
    _set_chat_template(tokenizer, chat_template)
    method = prequantized.method if prequantized is not None else quantization
    return ModelSource(path, name, hf_config, tokenizer, _eos_ids(tokenizer, hf_config, path),
                       quantization=method, quantization_group_size=quantization_group_size, prequantized=prequantized)


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
                         "tensors), and its blocks are served as stored (--gguf-weights native): drop --quantization")


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
    from engine.quant.quantize import AT_LOAD_METHODS

    if source.prequantized is not None:
        return PrequantizedTensors(SafetensorsFolder(source.path), source.prequantized)
    tensors = GGUFTensors(source.path, source.gguf_weights) if source.is_gguf else SafetensorsFolder(source.path)
    if source.quantization in AT_LOAD_METHODS:
        names = list(tensors.types) if source.is_gguf else list(tensors.files)
        return QuantizeAtLoad(tensors, names, source.quantization, source.quantization_group_size)
    return tensors


def _target(model: torch.nn.Module, name: str, params: dict) -> str | None:
    """The parameter checkpoint tensor `name` loads into, or None where none here does."""
    tied = getattr(model, "tie_word_embeddings", False)
    if "rotary_emb" in name or (name == "lm_head.weight" and tied):
        return None
    target, _ = model.checkpoint_target(name)
    if name == "model.embed_tokens.weight" and tied and "lm_head.weight" in params:
        target = "lm_head.weight"  # a last pipeline stage's own copy of the tied matrix (it has no embeddings)
    return target if target in params else None


def _block_holder(modules: dict[str, torch.nn.Module], target: str, vocabulary: bool = False) -> torch.nn.Module | None:
    """The layer whose weight `target` is, when it can keep its weight as blocks (quantize_weight):
    a linear layer, or with `vocabulary` (a GGUF file's own blocks) an embedding or LM head too
    (quantizing a float checkpoint leaves those float, as vLLM does); None for any other parameter
    (norms, experts, biases)."""
    from engine.layers.embedding import VocabParallelEmbedding

    module = modules.get(target.rpartition(".")[0])
    if not target.endswith(".weight") or not hasattr(module, "quantize_weight"):
        return None
    return module if vocabulary or not isinstance(module, VocabParallelEmbedding) else None


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
        module = _block_holder(modules, target, vocabulary=True)
        holder = module is not None
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
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # a tied LM head now reads the embedding's blocks
    if dequantized:
        how = "as asked (gguf_weights='dequantize')" if tensors.gguf_weights == "dequantize" else "not natively"
        more = f", ... ({len(dequantized) - 4} more)" if len(dequantized) > 4 else ""
        native_note = f"; kept as stored: {', '.join(FORMATS)}" if tensors.gguf_weights == "native" else ""
        logger.warning("GGUF: %d quantized tensor(s) dequantized to float, %s: %s%s", len(dequantized), how,
                       ", ".join(dequantized[:4]) + more, native_note)


class SafetensorsFolder:
    """A safetensors folder's tensors: whole by name (`get`; pre-quantized checkpoints read a module's
    parts together), or iterated as (name, SafetensorsSlice) in file order: read lazily, so a
    tensor-parallel rank's weight_loaders read only its slice of each tensor. Each file is opened
    once; `bytes_read` counts the tensor bytes read so far."""

    def __init__(self, path: str):
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"no *.safetensors files in {path!r}")
        self.files: dict[str, str] = {}  # tensor name -> its file
        for file in files:
            with safe_open(file, framework="pt") as f:
                self.files.update((name, file) for name in f.keys())
        self.open: dict[str, object] = {}
        self.bytes_read = 0

    def _file(self, name: str):
        from safetensors import safe_open

        file = self.files[name]
        if file not in self.open:
            self.open[file] = safe_open(file, framework="pt")
        return self.open[file]

    def _count(self, tensor: torch.Tensor) -> None:
        self.bytes_read += tensor.numel() * tensor.element_size()

    def get(self, name: str) -> torch.Tensor:
        tensor = self._file(name).get_tensor(name)
        self._count(tensor)
        return tensor

    def __iter__(self) -> Iterator[tuple[str, SafetensorsSlice]]:
        stored = 0
        for name in self.files:
            tensor = SafetensorsSlice(self._file(name).get_slice(name), on_read=self._count)
            stored += tensor.numel() * tensor.stored_dtype.itemsize
            yield name, tensor
        logger.info("checkpoint: read %.1f MiB of its %.1f MiB (this process's slices)",
                    self.bytes_read / 2**20, stored / 2**20)


def _float_kept(targets: set[str], what: str, why: str) -> None:
    """Log which matrices stay float under `what`: the embeddings and LM head (as vLLM keeps them),
    and, louder, any other (`why`)."""
    embeddings = sorted(t for t in targets if "embed_tokens" in t or t.startswith("lm_head"))
    others = sorted(targets - set(embeddings))
    if embeddings:
        logger.info("%s: kept float, as in vLLM: %s", what, ", ".join(embeddings))
    if others:
        more = f", ... ({len(others) - 4} more)" if len(others) > 4 else ""
        logger.warning("%s: %d matrices kept float (%s): %s%s", what, len(others), why, ", ".join(others[:4]), more)


class QuantizeAtLoad:
    """A float checkpoint's tensors with the linear weights quantized on the way (--quantization int8 /
    int4, engine/quant/quantize.py); choose_layers turns those layers into block-format layers first."""

    def __init__(self, tensors: Iterable[tuple[str, object]], names: list[str], method: str, group_size: int):
        self.tensors, self.names, self.method, self.group_size = tensors, names, method, group_size
        self.quantized: set[str] = set()

    def choose_layers(self, model: torch.nn.Module) -> None:
        from engine.quant.quantize import block_format, check_quantizable, describe

        params = dict(model.named_parameters())
        modules = dict(model.named_modules())
        layers, kept = set(), set()
        for name in self.names:
            target = _target(model, name, params)
            if target is None or params[target].dim() < 2:
                continue
            module = _block_holder(modules, target)
            if module is None:
                kept.add(target)
                continue
            if module.quant_format is None:
                # Per rank, as vLLM asks of pre-quantized groups: no group straddles two ranks.
                check_quantizable(module.weight.shape[1], self.method, self.group_size, target)
                module.quantize_weight(block_format(self.method))
            layers.add(target)
            self.quantized.add(name)
        what = f"--quantization {self.method}"
        logger.info("%s: %d linear layers quantized at load: %s", what, len(layers),
                    describe(self.method, self.group_size))
        _float_kept(kept, what, "no quantized kernel for their layers")

    def __iter__(self):
        from engine.quant.quantize import quantize

        for name, tensor in self.tensors:
            if name in self.quantized and isinstance(tensor, SafetensorsSlice):
                tensor = tensor.read()  # quantized whole; each rank's loader slices the blocks
            if name in self.quantized and isinstance(tensor, torch.Tensor):
                tensor = quantize(tensor, self.method, self.group_size)
            yield name, tensor


class PrequantizedTensors:
    """A pre-quantized folder's tensors (engine/quant/prequantized.py): each quantized linear's parts
    (qweight, scales, ...) come as one `<module>.weight` QuantizedTensor in a GGUF block format, or,
    for a parameter that keeps float weights, dequantized (logged by choose_layers)."""

    def __init__(self, tensors: SafetensorsFolder, reader):
        self.tensors, self.reader = tensors, reader
        self.modules: dict[str, dict[str, str]] = {}  # module -> {part suffix: checkpoint name}
        for name in tensors.files:
            module, _, suffix = name.rpartition(".")
            if suffix == reader.marker:
                self.modules[module] = {}
        for name in tensors.files:
            module, _, suffix = name.rpartition(".")
            if module in self.modules and suffix in reader.parts:
                self.modules[module][suffix] = name
        self.wanted: set[str] = set()  # modules whose weight this process loads
        self.to_float: set[str] = set()

    def choose_layers(self, model: torch.nn.Module) -> None:
        params = dict(model.named_parameters())
        modules = dict(model.named_modules())
        layers: dict[str, str] = {}
        for prefix in self.modules:
            target = _target(model, prefix + ".weight", params)
            if target is None:
                continue
            self.wanted.add(prefix)
            module = _block_holder(modules, target)
            fmt = self.reader.scheme_for(prefix).block_format
            if module is None:
                self.to_float.add(prefix)
            elif module.quant_format is None:
                module.quantize_weight(fmt)
                layers[target] = fmt.name
            elif module.quant_format is not fmt:
                raise ValueError(f"{prefix}: its {self.reader.method} scheme makes {fmt.name} blocks, but another part "
                                 f"of {target} made {module.quant_format.name}: the parts of one fused layer must "
                                 "share one scheme")
        formats = ", ".join(f"{n} as {f}" for f, n in
                            sorted({f: sum(v == f for v in layers.values()) for f in layers.values()}.items()))
        logger.info("%s checkpoint: %d linear layers converted at load to GGUF blocks (%s; scales and zero points "
                    "repeated in each 32-block of their group, served by the GGUF kernels)",
                    self.reader.describe(), len(layers), formats or "none")
        if self.to_float:
            logger.warning("%s checkpoint: %d quantized tensor(s) dequantized to float, their parameters keep float "
                           "weights here: %s", self.reader.method, len(self.to_float), ", ".join(sorted(self.to_float)))
        parts = {name for names in self.modules.values() for name in names.values()}
        floats = {t for name in self.tensors.files if name not in parts
                  and (t := _target(model, name, params)) is not None and params[t].dim() >= 2}
        _float_kept(floats, f"{self.reader.method} checkpoint", "stored float in the checkpoint")

    def __iter__(self):
        parts = {name for names in self.modules.values() for name in names.values()}
        changed = 0.0
        for name in self.tensors.files:
            module, _, suffix = name.rpartition(".")
            if module in self.modules and suffix == self.reader.marker:
                if module not in self.wanted:
                    continue
                blocks, change = self.reader.to_blocks(module, {s: self.tensors.get(n)
                                                                for s, n in self.modules[module].items()})
                changed = max(changed, change)
                yield module + ".weight", blocks.dequantize() if module in self.to_float else blocks
            elif name not in parts:
                yield name, self.tensors.get(name)
        if changed:
            logger.info("%s checkpoint: scales rounded to fp16 for the blocks (largest relative change %.2g)",
                        self.reader.method, changed)


def load_weights(model: torch.nn.Module, tensors: Iterable[tuple[str, object]]) -> None:
    """Route each checkpoint tensor to its parameter's weight_loader; every parameter must be filled."""
    if isinstance(tensors, GGUFTensors):
        choose_native_weights(model, tensors)
    elif hasattr(tensors, "choose_layers"):
        tensors.choose_layers(model)
    params = dict(model.named_parameters())
    missing = set(params)
    for name, tensor in tensors:
        if (target := _target(model, name, params)) is None:
            continue  # another pipeline stage's layer, or a tensor this model does not use
        _, shard_id = model.checkpoint_target(name)
        param = params[target]
        loader = param.weight_loader if hasattr(param, "weight_loader") else _copy
        if isinstance(tensor, torch.Tensor) and getattr(param, "quant_format", None) is None:
            tensor = tensor.to(param.dtype)  # (a float tensor bound for blocks is refused by the weight loader)
        loader(param, tensor) if shard_id is None else loader(param, tensor, shard_id)
        missing.discard(target)
    if missing:
        raise ValueError(f"checkpoint has no tensors for parameters: {sorted(missing)[:8]}")


def _copy(param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
    param.data.copy_(tensor)
