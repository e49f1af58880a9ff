"""`--quantization int8 | int4` (engine/quant/quantize.py): float weights quantized at load into
GGUF Q8_0 / Q4_1 blocks. The oracles: a float64 numpy quantizer written here from the spec (the
blocks must match it byte for byte), gguf.quants.dequantize (llama.cpp's own decoder) for what those
bytes mean, and transformers running a float model that holds exactly those dequantized weights
(the engine's greedy tokens must equal its tokens)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize
from safetensors.torch import load_file, save_file

from engine import LLM, EngineConfig
from engine.loading.loader import resolve_model
from engine.quant.quantize import quantize
from tests.engine.engine_runs import engine_greedy, loaded_model
from tests.engine.hf_oracle import hf_greedy
from tests.tiny_model import build_tiny_model

PROMPTS = [[5, 9, 33, 100, 7], list(range(3, 60)), [77], [200, 201, 202, 203] * 5, [11, 300, 12, 301],
           list(range(400, 440, 3))]
MAX_TOKENS = 16
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Hidden 128 and MLP 256: every linear's inputs are whole groups of 128 (and of 32).
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
METHODS = [("int8", 128), ("int4", 128), ("int4", 32)]


# ---- the float64 reference quantizer (numpy), written from the spec in engine/quant/quantize.py ----

def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).astype(np.float16)


def _safe(d: np.ndarray) -> np.ndarray:
    return np.where(d > 0, d, 1.0)


def ref_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(d fp16 [N], q int8 [N, K]): d = amax(|row|) / 127, q = round-half-even(w / d) in [-127, 127]."""
    x = w.astype(np.float64)
    d = _fp16(np.abs(x).max(axis=1) / 127)
    dd = d.astype(np.float64)[:, None]
    q = np.where(dd > 0, np.rint(x / _safe(dd)), 0).clip(-127, 127).astype(np.int8)
    return d, q


def ref_int4(w: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(d, m fp16 [N, K / g], q uint8 [N, K]): d = (max - min) / 15, m = min, q = round((w - m) / d)."""
    n, k = w.shape
    x = w.astype(np.float64).reshape(n, k // g, g)
    lo, hi = x.min(axis=2), x.max(axis=2)
    d, m = _fp16((hi - lo) / 15), _fp16(lo)
    dd, mm = d.astype(np.float64)[..., None], m.astype(np.float64)[..., None]
    q = np.where(dd > 0, np.rint((x - mm) / _safe(dd)), 0).clip(0, 15).astype(np.uint8)
    return d, m, q.reshape(n, k)


def _per_block(x: np.ndarray, k: int) -> np.ndarray:
    """[N] or [N, G] -> [N, K / 32] fp16 bytes [N, K / 32, 2]: each value repeated in its 32-blocks."""
    x = x.reshape(x.shape[0], -1)
    return np.repeat(x, k // 32 // x.shape[1], axis=1).astype("<f2").view(np.uint8).reshape(x.shape[0], -1, 2)


def q8_0_bytes(d: np.ndarray, q: np.ndarray) -> np.ndarray:
    n, k = q.shape
    return np.concatenate([_per_block(d, k), q.view(np.uint8).reshape(n, k // 32, 32)], axis=2).reshape(n, -1)


def q4_1_bytes(d: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    n, k = q.shape
    blocks = q.reshape(n, k // 32, 32)
    nibbles = blocks[:, :, :16] | (blocks[:, :, 16:] << 4)  # GGUF: low nibbles weights 0..15, high 16..31
    return np.concatenate([_per_block(d, k), _per_block(m, k), nibbles], axis=2).reshape(n, -1)


def reference_blocks(w: np.ndarray, method: str, g: int) -> tuple[np.ndarray, str]:
    if method == "int8":
        return q8_0_bytes(*ref_int8(w)), "Q8_0"
    return q4_1_bytes(*ref_int4(w, g)), "Q4_1"


def gguf_dequantize(blocks: np.ndarray, kind: str) -> np.ndarray:
    return dequantize(blocks, gguf.GGMLQuantizationType[kind]).astype(np.float32)


# ---- blocks and error bounds ----

def _hard_matrix(rng: np.random.Generator, rows: int = 24, k: int = 256) -> np.ndarray:
    """Random rows plus the cases that break quantizers: a zero row, a constant row, a row far from
    zero (all of one sign), rows whose scales are tiny (fp16 subnormal) or large, exact ties."""
    w = rng.standard_normal((rows, k)).astype(np.float32) * 0.05
    w[0] = 0
    w[1] = 0.3
    w[2] = 5 + rng.random(k).astype(np.float32) * 0.01
    w[3] *= 1e-4
    w[4] *= 300
    # Ties: amax = 127 * 2^-7 (d = 2^-7 exactly), values at (j + 1/2) d, rounded half to even.
    w[5] = (np.arange(k) % 50 - 25 + 0.5).astype(np.float32) / 128
    w[5, 0] = 127 / 128
    return w


def _bound_int8(w: np.ndarray, d: np.ndarray) -> np.ndarray:
    """|w - w'| <= max(d / 2, amax - 127 d): q's rounding, or the clamp where fp16 rounded d down."""
    d = d.astype(np.float64)[:, None]
    amax = np.abs(w.astype(np.float64)).max(axis=1, keepdims=True)
    return np.maximum(d / 2, amax - 127 * d)


def _bound_int4(w: np.ndarray, g: int, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    n, k = w.shape
    x = w.astype(np.float64).reshape(n, k // g, g)
    lo, hi = x.min(axis=2, keepdims=True), x.max(axis=2, keepdims=True)
    dd, mm = d.astype(np.float64)[..., None], m.astype(np.float64)[..., None]
    bound = np.maximum(np.maximum(dd / 2, hi - (15 * dd + mm)), mm - lo)
    # ... which is fp16's rounding of the scale and min (half an ulp: 2^-11 relative, 2^-25 below
    # fp16's normal range) times 15 and 1: at most this above d / 2.
    fp16_slack = 2.0 ** -11 * ((hi - lo) + np.abs(lo)) + 16 * 2.0 ** -25
    assert (bound <= dd / 2 + fp16_slack).all()
    return np.broadcast_to(bound, x.shape).reshape(n, k)


def test_int8_blocks_are_the_reference_bytes_within_the_stated_bound():
    w = _hard_matrix(np.random.default_rng(0))
    qt = quantize(torch.from_numpy(w), "int8")
    assert qt.format.name == "Q8_0" and qt.blocks.shape == (w.shape[0], w.shape[1] // 32 * 34)
    assert np.array_equal(qt.blocks.numpy(), q8_0_bytes(*ref_int8(w)))
    d, q = ref_int8(w)
    assert np.abs(q).max() <= 127 and q[0].max() == 0
    assert np.array_equal(q[5, 1:5], [-24, -22, -22, -20])  # -23.5, -22.5, -21.5, -20.5: half to even
    back = gguf_dequantize(qt.blocks.numpy(), "Q8_0")
    assert np.array_equal(back, qt.dequantize().numpy())  # engine's decoder = llama.cpp's
    err = np.abs(back.astype(np.float64) - w)
    assert (err <= _bound_int8(w, d) * (1 + 1e-6) + 1e-30).all()
    normal = d.astype(np.float64) >= 2.0 ** -14
    assert (err[normal] <= d.astype(np.float64)[normal][:, None] / 2 * (1 + 1e-6)).all()  # d / 2 where fp16 is normal


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lm_head_q8_0_blocks_are_llama_cpps(dtype):
    """--quantize-lm-head under int8 / int4: GGUF's own Q8_0 (a scale per 32 weights, round half away
    from zero), byte for byte gguf-py's quantizer on the hard rows (a zero row, ties, tiny and large
    scales), as the weights' dtype gives them; 3,000 rows: quantized in more than one chunk."""
    from engine.quant.quantize import lm_head_format, quantize_lm_head

    w = np.concatenate([_hard_matrix(np.random.default_rng(1), rows=24, k=4096),
                        np.random.default_rng(2).standard_normal((2976, 4096)).astype(np.float32)])
    w = torch.from_numpy(w).to(dtype)
    for method in ("int8", "int4"):
        qt = quantize_lm_head(w, method)
        assert qt.format.name == lm_head_format(method).name == "Q8_0"
        assert np.array_equal(qt.blocks.numpy(), gguf_quantize(w.float().numpy(), gguf.GGMLQuantizationType.Q8_0))
    with pytest.raises(ValueError, match="--quantize-lm-head: the LM head has 40 inputs per row, not a multiple of "
                                         "the 32-weight blocks.*drop --quantize-lm-head"):
        quantize_lm_head(torch.zeros(4, 40), "int4")


@pytest.mark.parametrize("g", [32, 128])
def test_int4_blocks_are_the_reference_bytes_within_the_stated_bound(g):
    w = _hard_matrix(np.random.default_rng(1))
    qt = quantize(torch.from_numpy(w), "int4", g)
    assert qt.format.name == "Q4_1" and qt.blocks.shape == (w.shape[0], w.shape[1] // 32 * 20)
    d, m, q = ref_int4(w, g)
    assert np.array_equal(qt.blocks.numpy(), q4_1_bytes(d, m, q))
    back = gguf_dequantize(qt.blocks.numpy(), "Q4_1")
    assert np.array_equal(back, qt.dequantize().numpy())
    err = np.abs(back.astype(np.float64) - w)
    # float32's rounding of d * q + m is the only thing beyond the bound.
    assert (err <= _bound_int4(w, g, d, m) + 2.0 ** -23 * np.abs(w) + 1e-30).all()


def test_int4_constant_and_zero_groups():
    w = np.zeros((2, 128), dtype=np.float32)
    w[1] = 0.25  # fp16-exact
    back = quantize(torch.from_numpy(w), "int4", 128).dequantize().numpy()
    assert np.array_equal(back, w)
    assert not quantize(torch.from_numpy(w), "int8").dequantize()[0].any()  # a zero row: d = 0, no NaN


def test_bits_per_weight_stored():
    w = torch.randn(64, 512)
    assert quantize(w, "int8").blocks.numel() * 8 / w.numel() == 8.5
    assert quantize(w, "int4", 128).blocks.numel() * 8 / w.numel() == 5.0
    assert quantize(w, "int4", 32).blocks.numel() * 8 / w.numel() == 5.0


# ---- the engine, end to end ----

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    cache = {}

    def get(arch: str) -> str:
        if arch not in cache:
            # qwen2: q/k/v biases, tied head; llama-tied: Llama with a tied head
            model_type, tied = {"llama": ("llama", False), "qwen2": ("qwen2", True),
                                "llama-tied": ("llama", True)}[arch]
            cache[arch] = build_tiny_model(tmp_path_factory.mktemp(arch), model_type=model_type,
                                           tie_word_embeddings=tied, **SHAPE)
        return cache[arch]

    return get


def write_float_folder(src: str, dst, weights: dict[str, torch.Tensor], dtype=torch.float32) -> str:
    """A copy of folder `src` (config, tokenizer) whose model.safetensors holds `weights` over the
    original tensors, saved in `dtype`."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors.update(weights)
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


def greedy(path: str, **config) -> list[list[int]]:
    return engine_greedy(path, PROMPTS, MAX_TOKENS, num_kv_blocks=64, max_model_len=256, dtype="float32", **config)


def hf_tokens(path: str) -> list[list[int]]:
    return [hf_greedy(path, p, MAX_TOKENS) for p in PROMPTS]


def dequantized_copy(folder: str, dst, method: str, g: int, also: tuple[str, ...] = ()) -> tuple[dict, str]:
    """(the reference blocks by checkpoint name, a float copy of `folder` holding their dequantized
    values): every linear layer's weight, and the tensors named in `also` (the LM head's matrix).
    fp8's reference is the engine's quantizer (checked byte for byte in test_fp8_weights.py)."""
    ref, dequantized = {}, {}
    for name, w in load_file(os.path.join(folder, "model.safetensors")).items():
        if not ((name.split(".")[-2] in LINEARS and name.endswith(".weight")) or name in also):
            continue
        if method == "fp8":
            blocks = quantize(w, "fp8")
            ref[name], dequantized[name] = blocks.blocks.numpy(), blocks.dequantize()
        else:
            if name in also:  # the head at 8 bits, GGUF's own Q8_0: gguf-py's quantizer is the reference
                ref[name], kind = gguf_quantize(w.float().numpy(), gguf.GGMLQuantizationType.Q8_0), "Q8_0"
            else:
                ref[name], kind = reference_blocks(w.numpy(), method, g)
            dequantized[name] = torch.from_numpy(gguf_dequantize(ref[name], kind))
    return ref, write_float_folder(folder, dst, dequantized)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("method,g", METHODS)
def test_engine_tokens_equal_transformers_on_the_dequantized_weights(tmp_path, folders, arch, method, g):
    folder = folders(arch)
    ref, oracle = dequantized_copy(folder, tmp_path / "dequantized", method, g)
    want = hf_tokens(oracle)

    # The loaded layers hold the reference's bytes (q, k, v fused, gate and up fused).
    model = loaded_model(folder, quantization=method, quantization_group_size=g)
    attn = model.model.layers["0"].self_attn.qkv_proj
    assert attn.quant_format.name == ("Q8_0" if method == "int8" else "Q4_1")
    fused = np.concatenate([ref[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert np.array_equal(attn.weight.numpy(), fused)
    down = model.model.layers["1"].mlp.down_proj.weight
    assert np.array_equal(down.numpy(), ref["model.layers.1.mlp.down_proj.weight"])
    assert model.model.embed_tokens.weight.dtype == torch.float32  # embeddings stay float, as in vLLM

    for backend in ("cpu", "torch"):  # C++ block kernels; dequantize + F.linear
        assert greedy(folder, quantization=method, quantization_group_size=g, attention_backend=backend) == want


@pytest.mark.parametrize("arch,method,backends", [
    ("llama-tied", "int4", ("cpu", "torch")),  # C++ block kernels; dequantize + F.linear (and the lookup's rows)
    ("llama", "int4", ("cpu", "torch")),
    ("llama-tied", "fp8", ("torch",)),  # the cpu backend has no fp8 matmul
])
def test_quantize_lm_head_tokens_equal_transformers_on_the_dequantized_weights(tmp_path, folders, caplog, arch,
                                                                               method, backends):
    """--quantize-lm-head: the LM head's matrix as blocks too. Tied, that is the embedding's: one
    matrix of blocks, which the lookup reads as dequantized rows; untied, the embedding (only looked
    up) stays float. The oracle: transformers on a copy holding the dequantized values of every
    quantized matrix, the head's included."""
    if method == "fp8" and getattr(torch, "float8_e4m3fn", None) is None:
        pytest.skip("this torch has no float8_e4m3fn")
    folder, tied = folders(arch), arch.endswith("-tied")
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    ref, oracle = dequantized_copy(folder, tmp_path / "dequantized", method, 128, also=(head,))
    want = hf_tokens(oracle)

    with caplog.at_level(logging.INFO, logger="engine.loading.weights"):
        model = loaded_model(folder, quantization=method, quantize_lm_head=True)
    kind = {"int4": "Q8_0", "fp8": "F8_E4M3"}[method]  # an 8-bit head under int4, as llama.cpp's Q4 files
    assert model.lm_head.quant_format.name == kind
    assert np.array_equal(model.lm_head.weight.numpy(), ref[head])
    embed = model.model.embed_tokens
    if tied:
        assert embed.weight is model.lm_head.weight and embed.quant_format.name == kind
        assert (f"8 linear layers and the LM head (tied: model.embed_tokens.weight, as {kind}) quantized at load"
                in caplog.text)
        assert "kept float" not in caplog.text
    else:
        assert embed.quant_format is None and embed.weight.dtype == torch.float32
        assert f"8 linear layers and the LM head (lm_head.weight, as {kind}) quantized at load" in caplog.text
        assert "kept float, an untied embedding is only looked up: model.embed_tokens.weight" in caplog.text

    for backend in backends:
        assert greedy(folder, quantization=method, quantize_lm_head=True, attention_backend=backend) == want


def test_bf16_checkpoint_and_the_start_up_log(tmp_path, folders, caplog):
    """A bf16 checkpoint quantizes from its bf16 values; the log says what the layers hold and the
    resident bytes."""
    folder = folders("llama")
    bf16 = write_float_folder(folder, tmp_path / "bf16", {}, dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO):
        llm = LLM(bf16, device="cpu", num_kv_blocks=16, max_model_len=128, quantization="int8")
    try:
        layer = llm.engine.runner.model.model.layers["0"].mlp.gate_up_proj
        w = load_file(os.path.join(bf16, "model.safetensors"))
        gate_up = np.concatenate([w[f"model.layers.0.mlp.{p}_proj.weight"].float().numpy() for p in ("gate", "up")])
        assert np.array_equal(layer.weight.numpy(), q8_0_bytes(*ref_int8(gate_up)))
    finally:
        llm.shutdown()
    assert "--quantization int8: 8 linear layers quantized at load" in caplog.text
    assert "8.5 bits per weight stored" in caplog.text
    assert "weights resident:" in caplog.text and "8 matrices Q8_0" in caplog.text
    assert "kept float, as in vLLM (--quantize-lm-head quantizes the LM head and a tied embedding): " \
           "lm_head.weight, model.embed_tokens.weight" in caplog.text


def test_float_gguf_quantizes_at_load(tmp_path, folders):
    """A float GGUF takes --quantization too (its tensors come as float32)."""
    from tests.engine.quant.test_gguf_native import write_gguf

    folder = folders("llama")
    path = tmp_path / "f32.gguf"
    write_gguf(path, folder, "llama", None)
    model = loaded_model(str(path), quantization="int4", quantization_group_size=32)
    down = model.model.layers["0"].mlp.down_proj
    assert down.quant_format.name == "Q4_1"
    w = load_file(os.path.join(folder, "model.safetensors"))["model.layers.0.mlp.down_proj.weight"].numpy()
    assert np.array_equal(down.weight.numpy(), q4_1_bytes(*ref_int4(w, 32)))


def test_cli_flags_reach_the_config():
    from engine.arg_utils import ArgumentParser, add_engine_args, engine_config_from_args

    parser = ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--quantization", "int4", "--quantization-group-size", "32"]))
    assert (config.quantization, config.quantization_group_size) == ("int4", 32)
    assert engine_config_from_args(parser.parse_args([])).quantization is None
    assert engine_config_from_args(parser.parse_args(["--quantization", "int8", "--quantize-lm-head"])).quantize_lm_head
    assert not engine_config_from_args(parser.parse_args([])).quantize_lm_head
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization-group-size", "64"])


# ---- bad input: ValueError naming the flag and what to change ----

@pytest.mark.parametrize("kwargs,match", [
    (dict(quantization="int3"), "quantization must be None or one of"),
    (dict(quantization="int4", quantization_group_size=64), "quantization_group_size must be one of"),
    (dict(quantization="int8", quantization_group_size=32), "quantization_group_size must be left at 128"),
    (dict(quantize_lm_head=True), r"quantize_lm_head must be False unless quantization is one of \('int8', 'int4', "
                                  r"'fp8'\).*add --quantization int4 .*or drop --quantize-lm-head, got True"),
    (dict(quantization="gptq", quantize_lm_head=True), "quantize_lm_head must be False unless quantization is"),
])
def test_bad_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_quantizing_a_quantized_gguf_is_refused(tmp_path, folders):
    from tests.engine.quant.test_gguf_native import write_gguf

    path = tmp_path / "q4.gguf"
    write_gguf(path, folders("llama"), "llama", "Q4_1")
    with pytest.raises(ValueError, match=r"--quantization int8: .* already quantized \(GGUF Q4_1 tensors\).*drop"):
        resolve_model(str(path), tokenizer_path=folders("llama"), quantization="int8")
    with pytest.raises(ValueError, match="--quantization gptq reads pre-quantized safetensors"):
        resolve_model(str(path), tokenizer_path=folders("llama"), quantization="gptq")


def _with_quantization_config(src: str, dst, qc: dict) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


def test_method_flags_against_the_checkpoint(tmp_path, folders):
    folder = folders("llama")
    gptq = _with_quantization_config(folder, tmp_path / "gptq",
                                     {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True})
    with pytest.raises(ValueError, match=r"--quantization int4: .* already quantized \(gptq.*drop --quantization"):
        resolve_model(gptq, quantization="int4")
    with pytest.raises(ValueError, match=r"--quantization awq: .* is a gptq checkpoint.*pass gptq"):
        resolve_model(gptq, quantization="awq")
    with pytest.raises(ValueError, match=r"--quantization gptq: .* not a pre-quantized checkpoint.*int8, int4 or fp8"):
        resolve_model(folder, quantization="gptq")
    bnb = _with_quantization_config(folder, tmp_path / "bnb", {"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(ValueError, match="'bitsandbytes': supported pre-quantized methods are gptq, awq"):
        resolve_model(bnb)


def test_group_size_must_divide_the_inputs(tmp_path):
    folder = build_tiny_model(tmp_path / "h96", hidden_size=96, intermediate_size=192, num_attention_heads=4,
                              num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"--quantization int4 --quantization-group-size 128: model\.layers\.0\..* "
                                         r"(96|192) inputs per row, not a multiple of 128: "
                                         r"use --quantization-group-size 32"):
        LLM(folder, device="cpu", num_kv_blocks=16, max_model_len=64, quantization="int4")
    assert loaded_model(folder, quantization="int4", quantization_group_size=32) is not None
    odd = build_tiny_model(tmp_path / "h80", hidden_size=80, intermediate_size=160, num_attention_heads=4,
                           num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"--quantization int8: .* 80 inputs per row, not a multiple of the 32"):
        loaded_model(odd, quantization="int8")
