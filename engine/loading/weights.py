"""Load a checkpoint's tensors into a model (ModelSource from engine/loading/loader.py).

Each parameter's own `weight_loader` copies its shard, so this file knows nothing about tensor
parallelism; a safetensors tensor is read lazily (engine/loading/safetensors_slices.py), so a rank reads
only the slice its loaders take.

A .gguf file's matrices stay in their block format (engine/quant) when every checkpoint tensor of
the layer has one type and the format is one engine.quant supports (`gguf_weights` "native", the
default): linear layers, and the token embedding and LM head (a tied head reads the embedding's
blocks); other quantized tensors (a layer with mixed types, MoE experts) are dequantized to float,
with a log line saying which. `gguf_weights="dequantize"` dequantizes every tensor.

With `keep_bf16` (keeps_bf16 says when) a float checkpoint's bfloat16 matrices stay bfloat16 as stored
(engine.quant.BF16: linear layers, embedding and LM head), half float32's bytes, for the C++ matmul
kernels (widened to float32 there, or bf16 dot products under bf16 rows).

A float checkpoint's linear weights (a safetensors folder's, or a float GGUF's) are quantized at
load with `quantization` "int8" / "int4" / "fp8" (engine/quant/quantize.py); those of a
safetensors folder whose config.json names a pre-quantized method (GPTQ, AWQ, compressed-tensors)
are converted from its layout (engine/quant/prequantized.py); either way into block formats,
served by the same kernels. Their embeddings and LM head keep float weights (as in vLLM), unless
`quantize_lm_head` quantizes at load the LM head and, with tied embeddings, the embedding matrix
the head reads, at 8 bits under int8 and int4 (GGUF's Q8_0, as llama.cpp's Q4 files hold them:
quantize.LM_HEAD_FORMATS; an untied embedding is only looked up, so it stays float). Layers
without a quantized kernel (MoE experts) keep float weights too; a log line names what stays
float, and a quantized checkpoint tensor bound for such a parameter is dequantized, with a log
line.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterable, Iterator

import torch

from engine.loading.loader import ModelSource
from engine.loading.safetensors_slices import SafetensorsSlice

logger = logging.getLogger(__name__)


class GGUFTensors:
    """A .gguf file's tensors, iterable like any checkpoint's (name, tensor) pairs, plus what
    load_weights needs to decide first which of them stay quantized: each one's GGUF type, and
    `native`, the names load_weights chose (set before iterating)."""

    def __init__(self, path: str, gguf_weights: str):
        from engine.loading.gguf_loader import load_gguf

        self.path = path
        self.gguf_weights = gguf_weights
        self.model = load_gguf(path, with_tokenizer=False)
        self.types = self.model.types()  # HF name -> (GGUF name, GGUF type name)
        self.native: set[str] = set()

    def __iter__(self):
        return self.model.tensors(self.native)


def keeps_bf16(enabled: bool, backend: str, dtype: torch.dtype) -> bool:
    """Whether a float checkpoint's bf16 matrices stay as stored (KeepBF16; `enabled`:
    EngineConfig.cpu_bf16_weights): on the cpu backend, in a float32 model (widened in its kernels); in a
    bf16 one where the CPU has no native bf16 matmul (oneDNN's is 3-8x slower there: widened too) or has
    it without AMX, where a decode row's bf16 dot products run 1.0-2.0x oneDNN's call on its packed copy
    (kernels/cpu_quant.cpp, "bf16 rows against BF16 weights"). With AMX oneDNN's packed copy stays (not
    measured here)."""
    if not enabled or backend != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if dtype == torch.float32:
        return True
    from kernels import cpu_quant

    return not cpu_quant.has_brgemm_bf16()


def checkpoint_tensors(source: ModelSource, keep_bf16: bool = False) -> Iterable[tuple[str, object]]:
    from engine.quant.quantize import AT_LOAD_METHODS

    if source.prequantized is not None:
        return PrequantizedTensors(SafetensorsFolder(source.path), source.prequantized)
    tensors = GGUFTensors(source.path, source.gguf_weights) if source.is_gguf else SafetensorsFolder(source.path)
    if source.quantization in AT_LOAD_METHODS:
        names = list(tensors.types) if source.is_gguf else list(tensors.files)
        return QuantizeAtLoad(tensors, names, source.quantization, source.quantization_group_size,
                              source.quantize_lm_head)
    if keep_bf16:
        return KeepBF16(tensors)
    return tensors


def _target(model: torch.nn.Module, name: str, params: dict) -> str | None:
    """The parameter checkpoint tensor `name` loads into, or None where none here does."""
    tied = getattr(model, "tie_word_embeddings", False)
    if "rotary_emb" in name or (name == "lm_head.weight" and tied):
        return None
    target, _ = model.checkpoint_target(name)
    if target == "model.embed_tokens.weight" and tied and "lm_head.weight" in params:
        target = "lm_head.weight"  # a last pipeline stage's own copy of the tied matrix (it has no embeddings)
    return target if target in params else None


def _is_vocabulary(target: str) -> bool:
    """Whether parameter `target` is a vocabulary matrix: the token embedding or the LM head."""
    return "embed_tokens" in target or target.startswith("lm_head")


def _block_holder(modules: dict[str, torch.nn.Module], target: str, vocabulary: bool = False) -> torch.nn.Module | None:
    """The layer whose weight `target` is, when it can keep its weight as blocks (quantize_weight):
    a linear layer, or with `vocabulary` (a GGUF file's own blocks, a float checkpoint's head under
    quantize_lm_head) an embedding or LM head too (quantizing a float checkpoint leaves those float
    by default, as vLLM does); None for any other parameter (norms, experts, biases)."""
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


class KeepBF16:
    """A float checkpoint's tensors with its bfloat16 matrices handed over as stored
    (engine.quant.BF16 blocks): choose_layers turns each linear layer, embedding and LM head whose
    checkpoint tensors are all bfloat16 (and whose inputs are whole blocks of 32) into a BF16 layer,
    after a GGUF file's own choice of native blocks; every other tensor passes through unchanged."""

    def __init__(self, tensors: GGUFTensors | SafetensorsFolder):
        self.tensors = tensors
        self.kept: set[str] = set()

    def _stored_types(self) -> dict[str, str]:
        """Checkpoint name -> its stored type's name ("BF16", "F32", "Q4_1", ...)."""
        if isinstance(self.tensors, GGUFTensors):
            return {name: kind for name, (_, kind) in self.tensors.types.items()}
        return self.tensors.stored_types()

    def choose_layers(self, model: torch.nn.Module) -> None:
        from engine.quant import BF16

        if isinstance(self.tensors, GGUFTensors):
            choose_native_weights(model, self.tensors)
        params = dict(model.named_parameters())
        modules = dict(model.named_modules())
        groups: dict[str, list[tuple[str, str]]] = {}  # target -> [(checkpoint name, stored type)]
        for name, kind in self._stored_types().items():
            if (target := _target(model, name, params)) is not None:
                groups.setdefault(target, []).append((name, kind))
        kept_bytes = 0
        for target, group in groups.items():
            module = _block_holder(modules, target, vocabulary=True)
            if module is None or module.quant_format is not None or any(kind != "BF16" for _, kind in group):
                continue
            if module.weight.shape[1] % BF16.block_size:
                continue  # inputs not whole blocks: converted to float32 as before
            module.quantize_weight(BF16)
            kept_bytes += module.weight.numel()
            self.kept.update(name for name, _ in group)
            if isinstance(self.tensors, GGUFTensors):
                self.tensors.native.update(name for name, _ in group)  # its rows come as stored, not via float32
        if hasattr(model, "tie_weights"):
            model.tie_weights()  # a tied LM head reads the embedding's bf16 blocks
        if self.kept:
            logger.info("bfloat16 matrices kept as stored (%.1f MiB; cpu_bf16_weights) for the C++ matmul kernels",
                        kept_bytes / 2**20)

    def __iter__(self):
        from engine.quant import BF16, QuantizedTensor

        for name, tensor in self.tensors:
            if name in self.kept and isinstance(tensor, SafetensorsSlice):  # a GGUF file's come as stored
                # Read whole (each rank's loader slices the blocks), in its stored dtype: bfloat16.
                tensor = QuantizedTensor(tensor.read().contiguous().view(torch.uint8), BF16)
            yield name, tensor


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

    def stored_types(self) -> dict[str, str]:
        """Tensor name -> its stored dtype as safetensors names it ("BF16", "F32", ...), from the headers."""
        return {name: self._file(name).get_slice(name).get_dtype() for name in self.files}

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


def _float_kept(targets: set[str], what: str, why: str, vocabulary_why: str = "as in vLLM") -> None:
    """Log which matrices stay float under `what`: the embeddings and LM head (`vocabulary_why`),
    and, louder, any other (`why`)."""
    embeddings = sorted(t for t in targets if _is_vocabulary(t))
    others = sorted(targets - set(embeddings))
    if embeddings:
        logger.info("%s: kept float, %s: %s", what, vocabulary_why, ", ".join(embeddings))
    if others:
        more = f", ... ({len(others) - 4} more)" if len(others) > 4 else ""
        logger.warning("%s: %d matrices kept float (%s): %s%s", what, len(others), why, ", ".join(others[:4]), more)


class QuantizeAtLoad:
    """A float checkpoint's tensors with the linear weights quantized on the way (--quantization int8 /
    int4 / fp8, engine/quant/quantize.py), and with `lm_head` the LM head (a tied embedding with it)
    in quantize.lm_head_format; choose_layers turns those layers into block-format layers first."""

    def __init__(self, tensors: Iterable[tuple[str, object]], names: list[str], method: str, group_size: int,
                 lm_head: bool = False):
        self.tensors, self.names, self.method, self.group_size = tensors, names, method, group_size
        self.lm_head = lm_head
        self.quantized: set[str] = set()  # checkpoint names quantized on the way
        self.vocabulary: set[str] = set()  # of those, the LM head's matrix (quantize_lm_head's format)

    def choose_layers(self, model: torch.nn.Module) -> None:
        from engine.quant.quantize import (block_format, check_lm_head_quantizable, check_quantizable, describe,
                                           lm_head_format)

        params = dict(model.named_parameters())
        modules = dict(model.named_modules())
        # A tied embedding is the head's matrix: quantized with it. An untied one is only looked up (no
        # matmul reads it), so it stays float.
        tied = getattr(model, "tie_word_embeddings", False)
        layers, kept = set(), set()
        for name in self.names:
            target = _target(model, name, params)
            if target is None or params[target].dim() < 2:
                continue
            module = _block_holder(modules, target, self.lm_head and (tied or target.startswith("lm_head")))
            if module is None:
                kept.add(target)
                continue
            if module.quant_format is None and _is_vocabulary(target):
                check_lm_head_quantizable(module.weight.shape[1], target)
                module.quantize_weight(lm_head_format(self.method))
                self.vocabulary.add(name)
            elif module.quant_format is None:
                # Per rank, as vLLM asks of pre-quantized groups: no group straddles two ranks.
                check_quantizable(module.weight.shape[1], self.method, self.group_size, target)
                module.quantize_weight(block_format(self.method))
            layers.add(target)
            self.quantized.add(name)
        if hasattr(model, "tie_weights"):
            model.tie_weights()  # a tied LM head now reads the embedding's blocks
        what = f"--quantization {self.method}"
        vocabulary = sorted(t for t in layers if _is_vocabulary(t))
        also = (f" and the LM head ({'tied: ' * tied}{', '.join(vocabulary)}, as "
                f"{lm_head_format(self.method).name})" if vocabulary else "")
        logger.info("%s: %d linear layers%s quantized at load: %s", what, len(layers) - len(vocabulary), also,
                    describe(self.method, self.group_size))
        _float_kept(kept, what, "no quantized kernel for their layers",
                    "an untied embedding is only looked up" if self.lm_head else "as in vLLM (--quantize-lm-head "
                    "quantizes the LM head and a tied embedding)")

    def __iter__(self):
        from engine.quant.quantize import quantize, quantize_lm_head

        for name, tensor in self.tensors:
            if name in self.quantized and isinstance(tensor, SafetensorsSlice):
                tensor = tensor.read()  # quantized whole; each rank's loader slices the blocks
            if name in self.vocabulary and isinstance(tensor, torch.Tensor):
                tensor = quantize_lm_head(tensor, self.method)
            elif name in self.quantized and isinstance(tensor, torch.Tensor):
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
    elif hasattr(tensors, "choose_layers"):  # KeepBF16 makes a GGUF file's native choice itself
        tensors.choose_layers(model)
    params = dict(model.named_parameters())
    missing = set(params)
    for name, tensor in _split_fused(model, tensors, params):
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


def _split_fused(model: torch.nn.Module, tensors: Iterable[tuple[str, object]], params: dict):
    """The checkpoint's tensors with each fused one this model loads (Phi-3's qkv_proj, gate_up_proj)
    split into its parts by the model's `checkpoint_parts`, so each part takes its own shard's loader."""
    split = getattr(model, "checkpoint_parts", None)
    for name, tensor in tensors:
        if split is not None and _target(model, name, params) is not None:
            yield from split(name, tensor)
        else:
            yield name, tensor


def _copy(param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
    param.data.copy_(tensor)
