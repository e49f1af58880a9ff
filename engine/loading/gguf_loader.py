"""Read a GGUF file (llama.cpp's format) as a Hugging Face-style model.

`load_gguf(path)` gives the transformers config, the tokenizer (with its chat
template), the generation settings, and `tensors()`: (HF parameter name, tensor)
pairs, float32 dequantized with the `gguf` package, or, for the names asked for
natively, the tensor as stored (engine.quant.QuantizedTensor: its GGUF blocks).
`types()` names each tensor's GGUF type before any is read, so the loader can decide
which layers keep their weights quantized (engine/loading/loader.py).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from transformers import (
    AutoTokenizer,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen3Config,
)

from engine.loading.gguf_header import GGUFHeader, open_gguf
from engine.quant import AS_STORED, FORMATS, QuantizedTensor

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> (config class, HF architecture name).
# llama.cpp writes Mistral and SmolLM2 as "llama" too.
_ARCHITECTURES = {
    "gemma2": (Gemma2Config, "Gemma2ForCausalLM"),
    "gemma3": (Gemma3TextConfig, "Gemma3ForCausalLM"),
    "llama": (LlamaConfig, "LlamaForCausalLM"),
    "phi3": (Phi3Config, "Phi3ForCausalLM"),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
}

# GGUF tensor names (llama.cpp's gguf-py MODEL_TENSOR table) -> HF parameter names.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",  # qwen3
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixtral (llama.cpp writes it as "llama" with an expert count): the router, and each layer's
    # experts merged into one 3-D tensor per matrix, [experts, out, in] in torch's order.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# Phi-3 keeps q/k/v and gate/up fused, as its checkpoints do (engine/models/phi3.py splits them).
_PHI3_BLOCK_NAMES = {**_BLOCK_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Gemma's four norms a layer: llama.cpp's ffn_norm is the norm before the MLP there, not after attention.
_GEMMA_BLOCK_NAMES = {**_BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_GEMMA_TYPES = ("gemma2", "gemma3_text")
# Tensors llama.cpp stores that are config here, not weights: Phi-3's LongRoPE factors.
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def _hf_name(gguf_name: str, model_type: str = "llama") -> str:
    if m := _BLOCK_RE.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        block_names = (_PHI3_BLOCK_NAMES if model_type == "phi3" else
                       _GEMMA_BLOCK_NAMES if model_type in _GEMMA_TYPES else _BLOCK_NAMES)
        if part in block_names:
            return f"model.layers.{layer}.{block_names[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in pagewise")


@functools.cache
def _dequantizable(kind) -> bool:
    """Whether gguf.quants dequantizes this type (one zero block, tried once)."""
    from gguf.constants import GGML_QUANT_SIZES

    try:
        dequantize(np.zeros(GGML_QUANT_SIZES[kind][1], dtype=np.uint8), kind)
    except NotImplementedError:
        return False
    return True


def _undequantizable(t) -> ValueError:
    return ValueError(f"GGUF tensor {t.name} is {t.tensor_type.name}, which the gguf package cannot dequantize "
                      f"here; supported: {', '.join(FORMATS)} as stored, other types that gguf.quants dequantizes "
                      "as float")


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    convert_hf_to_gguf.py (LlamaModel.permute) stores q_proj/k_proj rows as
        w.reshape(n_head, 2, head_dim // 2, ...).swapaxes(1, 2).reshape(w.shape)
    i.e. it interleaves the two rotate-half halves of each head into GPT-J-style
    (even, odd) pairs for ggml's rope. Swapping the same axes back restores HF order.
    """
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class GGUFModel:
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None  # None when the file has no tokenizer metadata
    generation_config: GenerationConfig
    reader: GGUFHeader | GGUFReader = field(repr=False)

    def types(self) -> dict[str, tuple[str, str]]:
        """HF name -> (GGUF tensor name, GGUF type name), e.g. ("blk.0.attn_q.weight", "Q4_1"). A type
        neither kept as stored nor dequantizable is refused here, before any plan for it is logged."""
        for t in self.reader.tensors:
            if t.tensor_type.name not in FORMATS and not _dequantizable(t.tensor_type):
                raise _undequantizable(t)
        return {_hf_name(t.name, self.config.model_type): (t.name, t.tensor_type.name) for t in self.reader.tensors
                if t.name not in _CONFIG_TENSORS}

    def tensors(self, native: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """Yield (HF name, float32 tensor), dequantizing one tensor at a time; a name in `native`
        (its type one of engine.quant.AS_STORED: a block format, or BF16) comes as stored instead, a
        QuantizedTensor."""
        cfg = self.config
        for t in self.reader.tensors:
            if t.name in _CONFIG_TENSORS:
                continue
            name = _hf_name(t.name, cfg.model_type)
            if name in native:
                # The raw blocks, [rows, row bytes]: each row is one output row, as dequantize() orders them.
                w = t.data
            else:
                # dequantize() returns rows in torch's (out_features, in_features) order.
                try:
                    w = dequantize(t.data, t.tensor_type)
                except NotImplementedError:
                    raise _undequantizable(t) from None
            # Only llama.cpp's LlamaModel converter (Llama, Mistral, Mixtral) permutes; qwen2/qwen3 keep HF order.
            # The permutation moves whole rows, so it applies to a row of blocks as to a row of floats.
            if cfg.model_type in ("llama", "mixtral"):
                if ".q_proj." in name:
                    w = _unpermute_rotary(w, cfg.num_attention_heads)
                elif ".k_proj." in name:
                    w = _unpermute_rotary(w, cfg.num_key_value_heads)
            if cfg.model_type in _GEMMA_TYPES and name.endswith("norm.weight"):
                w = w - 1.0  # llama.cpp's converter stores Gemma's norm scales as 1 + w; the model adds the 1
            if name in native:
                blocks = torch.from_numpy(np.array(w, dtype=np.uint8))
                yield name, QuantizedTensor(blocks, AS_STORED[t.tensor_type.name])
            else:
                yield name, torch.from_numpy(np.array(w, dtype=np.float32))  # copy: off the memmap


def _field(reader: GGUFHeader | GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    if f.types == [GGUFValueType.FLOAT32]:
        # Shortest repr that round-trips the float32 restores the HF value (1e-05, not 9.9999997e-06).
        return float(str(np.float32(f.contents())))
    return f.contents()


def _rope_scaling(reader: GGUFHeader | GGUFReader, arch: str) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind == "none" and (linear := _field(reader, f"{arch}.rope.scale_linear")):  # pre-2024 files
        kind, factor = "linear", linear
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor)}
        if (orig := _field(reader, f"{arch}.rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        for key in ("beta_fast", "beta_slow"):  # written by newer converters; YaRN's defaults (32, 1) otherwise
            if (value := _field(reader, f"{arch}.rope.scaling.yarn_{key}")) is not None:
                scaling[key] = value
        return scaling
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (supported: linear, yarn)")


def _phi3_fields(reader: GGUFHeader | GGUFReader, names: dict, head_dim: int) -> dict:
    """Phi-3's config fields as llama.cpp's converter writes them: the rotated dimensions of each head, the
    original length, LongRoPE's factors as two tensors (and its attention factor), no window as 0."""
    fields = dict(partial_rotary_factor=_field(reader, "phi3.rope.dimension_count", head_dim) / head_dim,
                  sliding_window=_field(reader, "phi3.attention.sliding_window") or None)
    if (original := _field(reader, "phi3.rope.scaling.original_context_length")) is not None:
        fields["original_max_position_embeddings"] = int(original)
    if "rope_factors_long.weight" in names:
        fields["rope_scaling"] = {"rope_type": "longrope",
                                  "long_factor": names["rope_factors_long.weight"].data.tolist(),
                                  "short_factor": names["rope_factors_short.weight"].data.tolist()}
        if (attention := _field(reader, "phi3.rope.scaling.attn_factor")) is not None:
            fields["rope_scaling"]["attention_factor"] = attention
    return fields


def _gemma_fields(reader: GGUFHeader | GGUFReader, arch: str, hidden: int, heads: int, head_dim: int,
                  layers: int) -> dict:
    """Gemma's config fields as llama.cpp reads them: the caps and the window from the file; what its
    converter leaves out as llama.cpp fixes it. The query scale is 1/sqrt(head_dim), but
    1/sqrt(hidden / heads) for the 27B models (46 layers in Gemma 2, 62 in Gemma 3); Gemma 3's window
    layers are five of six and rotate with base 10000, unless the file says otherwise."""
    fields = dict(sliding_window=_field(reader, f"{arch}.attention.sliding_window"),
                  query_pre_attn_scalar=hidden // heads if layers == {"gemma2": 46, "gemma3": 62}[arch] else head_dim)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = _field(reader, f"{arch}.{key}")
        if value is not None or arch == "gemma3":  # Gemma 2's defaults are llama.cpp's too
            fields[key] = value
    if arch == "gemma3":
        pattern = _field(reader, "gemma3.attention.sliding_window_pattern", 6)
        fields["layer_types"] = ["sliding_attention" if (pattern[i] if isinstance(pattern, list) else (i + 1) % pattern)
                                 else "full_attention" for i in range(layers)]
        fields["rope_local_base_freq"] = _field(reader, "gemma3.rope.freq_base_swa", 10000.0)
    return fields


def stored_dtype(reader: GGUFHeader | GGUFReader) -> str:
    """The dtype a Hugging Face config would record for this file's weights: "float32" when every
    matrix is F32, "float16" when they are F32/F16, else "bfloat16" (BF16 or quantized blocks: a
    16-bit checkpoint converted). engine.runner.model_runner.resolve_dtype reads it for dtype "auto"."""
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
    if kinds <= {"F32"}:
        return "float32"
    return "float16" if kinds <= {"F32", "F16"} else "bfloat16"


def gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The file's tokenizer as transformers converts it, kept in the cache folder after the first
    conversion. The conversion parses the whole file again and builds the vocabulary in Python:
    7.3 s for the default model's 49,152 tokens on the AVX2 machine, against 0.3 s to read the saved
    tokenizer.json (two of each made every start-up ~23 s). Keyed by the file's path, size and
    mtime, so a changed file converts again (user_cache.cached_folder: built once, published
    whole); where the cache cannot be written the tokenizer is converted each time."""
    import hashlib

    from engine.loading.user_cache import cached_folder

    path = os.path.abspath(path)
    st = os.stat(path)
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:20]
    folder, name = os.path.split(path)
    converted = []  # the tokenizer this call converted, if it did: no need to read it back

    def build(tmp: str) -> None:
        converted.append(AutoTokenizer.from_pretrained(folder, gguf_file=name))
        converted[0].save_pretrained(tmp)

    try:
        cached = cached_folder(os.path.join("gguf-tokenizers", f"{name}-{key}"), build)
    except OSError as e:
        logger.info("GGUF tokenizer not cached (%s): it is converted from the file at each start", e)
        return converted[0] if converted else AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return converted[0] if converted else AutoTokenizer.from_pretrained(cached)


def load_gguf(path: str | os.PathLike, with_tokenizer: bool = True) -> GGUFModel:
    """with_tokenizer=False leaves GGUFModel.tokenizer None (the weight loader reads only tensors)."""
    path = os.fspath(path)
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported GGUF architectures: {sorted(_ARCHITECTURES)}"
        )
    names = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in names:
        # llama.cpp stores Llama 3.1-style rope scaling as per-dimension factors, not as config.
        raise ValueError(f"{path}: GGUF rope_freqs (Llama 3.1 rope scaling) is not supported; use the HF checkpoint")

    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    eos_ids = [
        _field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")  # eot/eom: llama3 chat ends
    ]
    eos_ids = list(dict.fromkeys(i for i in eos_ids if i is not None))
    eos = eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None)
    special = dict(
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=eos,
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    head_dim = meta("attention.key_length")
    config_cls, hf_arch = _ARCHITECTURES[arch]
    experts = {}
    if (num_experts := meta("expert_count")) and arch == "llama":
        config_cls, hf_arch = MixtralConfig, "MixtralForCausalLM"
        experts = dict(num_local_experts=num_experts, num_experts_per_tok=meta("expert_used_count"))
    elif num_experts:
        raise ValueError(f"{path}: GGUF {arch!r} with experts is not supported; of the mixture-of-experts GGUF "
                         "files, Mixtral's (architecture 'llama' with llama.expert_count) is")
    phi3 = _phi3_fields(reader, names, head_dim or meta("embedding_length") // meta("attention.head_count")) \
        if arch == "phi3" else {}
    gemma = _gemma_fields(reader, arch, meta("embedding_length"), meta("attention.head_count"),
                          head_dim or meta("embedding_length") // meta("attention.head_count"),
                          meta("block_count")) if arch in ("gemma2", "gemma3") else {}
    rope_scaling = phi3.pop("rope_scaling", None) or _rope_scaling(reader, arch)
    config = config_cls(
        architectures=[hf_arch],
        **experts,
        **phi3,
        **gemma,
        # token_embd's row count is the vocab the weights have; `{arch}.vocab_size` is often absent.
        vocab_size=int(names["token_embd.weight"].shape[1]),
        hidden_size=meta("embedding_length"),
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=meta("attention.head_count"),
        num_key_value_heads=meta("attention.head_count_kv", meta("attention.head_count")),
        **({"head_dim": head_dim} if head_dim is not None else {}),
        max_position_embeddings=meta("context_length"),
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon"),
        rope_theta=meta("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in names,
        dtype=stored_dtype(reader),
        **special,
    )

    tokenizer = None
    if with_tokenizer and "tokenizer.ggml.model" in reader.fields:
        tokenizer = gguf_tokenizer(path)
        if (template := _field(reader, "tokenizer.chat_template")) is not None:
            tokenizer.chat_template = template
    return GGUFModel(config, tokenizer, GenerationConfig(**special), reader)
