"""Pre-quantized safetensors checkpoints (engine/quant/prequantized.py): GPTQ, AWQ and
compressed-tensors layouts, converted at load into GGUF blocks. Each checkpoint is written here
from a tiny random model: quantized by a float64 round-to-nearest reference (min-max, the methods'
own formulas), packed by numpy following each format's documented layout (cross-checked against
the compressed-tensors library's packer where it is installed, and against hand-computed words).
The oracles: transformers running a float model that holds the method's own dequantization,
W = s * (q - z), for the greedy tokens; that W for the loaded blocks (exact for symmetric 4-bit and
8-bit; within fp16's rounding of the min -s * z for asymmetric 4-bit)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.loading.loader import resolve_model
from tests.engine.quant.test_weight_quantization import (LINEARS, SHAPE, greedy, hf_tokens, loaded_model,
                                                         write_float_folder)
from tests.tiny_model import build_tiny_model

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds output column AWQ_ORDER[i] of its 8


# ---- the reference quantizer: float64 min-max round to nearest, per group of g inputs ----

def _stored(s: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """The scales as the checkpoint stores them (fp16 for GPTQ / AWQ, the model dtype for
    compressed-tensors), back in float64: quantizing against these makes s * (q - z) the checkpoint's W."""
    return torch.from_numpy(s.astype(np.float32)).to(dtype).double().numpy()


def rtn(w: np.ndarray, bits: int, g: int, sym: bool, scale_dtype: torch.dtype) -> tuple[np.ndarray, ...]:
    """w [N, K] -> (q [N, K] unsigned codes, z [N, G] unsigned zero points, s [N, G] float64 values
    of `scale_dtype`); w ~ s * (q - z). Symmetric: z = 2^(b-1), s = 2 amax / (2^b - 1) (AutoGPTQ's)."""
    n, k = w.shape
    g = k if g == -1 else g
    top = (1 << bits) - 1
    x = w.astype(np.float64).reshape(n, k // g, g)
    lo, hi = np.minimum(x.min(axis=2), 0), np.maximum(x.max(axis=2), 0)
    if sym:
        amax = np.maximum(-lo, hi)
        s = _stored(2 * amax / top, scale_dtype)
        z = np.full(s.shape, 1 << (bits - 1), dtype=np.int64)
    else:
        s = _stored((hi - lo) / top, scale_dtype)
        z = np.clip(np.rint(-lo / s), 0, top).astype(np.int64)
    ss = s[..., None]
    q = np.clip(np.rint(x / ss) + z[..., None], 0, top).astype(np.int64)
    return q.reshape(n, k), z, s


def dequantized(q: np.ndarray, z: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The method's own float weights: s * (q - z), float64 -> float32."""
    n, k = q.shape
    g = k // s.shape[1]
    x = (q.reshape(n, -1, g) - z[..., None]) * s[..., None]
    return x.reshape(n, k).astype(np.float32)


def as_q4_1(q: np.ndarray, z: np.ndarray, s: np.ndarray) -> np.ndarray:
    """What Q4_1 blocks of d = s, m = fp16(-s z) hold: float32(d q) + m, GGUF's two float32 roundings
    (s * (q - z) itself is not representable: the min is rounded to fp16)."""
    n, k = q.shape
    g = k // s.shape[1]
    d = s.astype(np.float32)[..., None]
    m = (-(s * z)).astype(np.float32).astype(np.float16).astype(np.float32)[..., None]
    return ((d * q.reshape(n, -1, g).astype(np.float32)) + m).reshape(n, k)


# ---- packing, following each format's layout ----

def pack(codes: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unsigned codes -> int32 words, 32 / bits consecutive codes along `axis` per word, code i of a
    word at bits [i * bits, (i + 1) * bits)."""
    per = 32 // bits
    c = np.moveaxis(codes.astype(np.uint64), axis, -1)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // per, per)
    words = (c << (np.arange(per, dtype=np.uint64) * bits)).sum(axis=-1).astype(np.uint32).view(np.int32)
    return np.ascontiguousarray(np.moveaxis(words, -1, axis))


def gptq_tensors(q, z, s, bits: int, v1: bool) -> dict[str, np.ndarray]:
    """GPTQ: qweight [K / per, N] packed along the input dim, qzeros [G, N / per] along the output dim
    (v1 stores z - 1, masked to the code width), scales [G, N] fp16, g_idx [K]."""
    k = q.shape[1]
    stored = (z - 1) & ((1 << bits) - 1) if v1 else z
    return {"qweight": pack(q.T, bits, axis=0), "qzeros": pack(stored.T, bits, axis=1),
            "scales": s.T.astype(np.float16), "g_idx": (np.arange(k) // (k // s.shape[1])).astype(np.int32)}


def awq_tensors(q, z, s) -> dict[str, np.ndarray]:
    """AWQ (gemm): qweight [K, N / 8] packed along the output dim in AWQ_ORDER, qzeros [G, N / 8]
    likewise, scales [G, N] fp16."""
    def awq_pack(codes):  # codes [R, N]: each 8 columns reordered, then packed in order
        r, n = codes.shape
        return pack(codes.reshape(r, n // 8, 8)[:, :, AWQ_ORDER].reshape(r, n), 4, axis=1)

    return {"qweight": awq_pack(q.T), "qzeros": awq_pack(z.T), "scales": s.T.astype(np.float16)}


def ct_tensors(q, z, s, bits: int, sym: bool, fmt: str) -> dict[str, torch.Tensor]:
    """compressed-tensors: signed values (code - 2^(b-1)); pack-quantized stores them + 2^(b-1) in
    weight_packed [N, K / per] (packed along the input dim), the asymmetric zero points packed along
    the output dim; int-quantized stores the int8 `weight`. weight_scale [N, G] in the model dtype."""
    n, k = q.shape
    out = {"weight_scale": torch.from_numpy(s).to(torch.bfloat16)}  # bf16-exact values (rtn)
    if fmt == "pack-quantized":
        out["weight_packed"] = torch.from_numpy(pack(q, bits, axis=1))
        out["weight_shape"] = torch.tensor([n, k])
        if not sym:
            out["weight_zero_point"] = torch.from_numpy(pack(z, bits, axis=0))
    else:
        out["weight"] = torch.from_numpy((q - (1 << (bits - 1))).astype(np.int8))
    return out


def test_packing_layouts_by_hand():
    """Words computed by hand from each layout's description: codes 0..7 along the packed dim."""
    codes = np.arange(8)[:, None]  # 8 inputs, 1 output
    assert pack(codes, 4, axis=0)[0, 0] == 0x76543210  # GPTQ qweight: input 8r + i at bits 4i
    q = np.arange(8)[:, None].repeat(32, axis=1)  # output n holds code n at every input
    words = awq_tensors(q, np.zeros((8, 1), np.int64), np.ones((8, 1)))["qweight"]
    assert words.shape == (32, 1) and (words == 0x75316420).all()  # AWQ: columns 0 2 4 6 1 3 5 7
    assert pack(np.array([[1, 2, 3, 4]]), 8, axis=1)[0, 0] == 0x04030201


def test_test_packer_matches_the_compressed_tensors_library():
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    rng = np.random.default_rng(0)
    for bits in (4, 8):
        signed = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), size=(16, 64))
        mine = pack(signed + (1 << (bits - 1)), bits, axis=1)
        assert np.array_equal(ct.pack_to_int32(torch.from_numpy(signed.astype(np.int8)), bits).numpy(), mine)
        mine0 = pack(signed + (1 << (bits - 1)), bits, axis=0)
        assert np.array_equal(ct.pack_to_int32(torch.from_numpy(signed.astype(np.int8)), bits, packed_dim=0).numpy(),
                              mine0)


# ---- checkpoints ----

# id -> (quantization_config, writer(q, z, s) -> tensors, bits, group, sym, scale dtype)
def _gptq(bits, g, sym, fmt="gptq"):
    qc = {"quant_method": "gptq", "bits": bits, "group_size": g, "desc_act": False, "sym": sym,
          "checkpoint_format": fmt}
    return qc, lambda q, z, s: gptq_tensors(q, z, s, bits, fmt == "gptq"), bits, g, sym, torch.float16


def _awq(g):
    qc = {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True, "version": "gemm"}
    return qc, awq_tensors, 4, g, False, torch.float16


def _ct(bits, g, sym, fmt="pack-quantized"):
    strategy = "group" if g != -1 else "channel"
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy,
               "group_size": g if g != -1 else None, "dynamic": False, "actorder": None, "observer": "minmax"}
    qc = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                        "output_activations": None}},
          "ignore": ["lm_head"]}
    return qc, lambda q, z, s: ct_tensors(q, z, s, bits, sym, fmt), bits, g, sym, torch.bfloat16


CHECKPOINTS = {
    "gptq-w4a16-g128-sym": _gptq(4, 128, True),
    "gptq-w4a16-g128-asym-v2": _gptq(4, 128, False, "gptq_v2"),
    "gptq-w4a16-g32-asym-v1": _gptq(4, 32, False),
    "gptq-w8a16-perchannel-sym": _gptq(8, -1, True),
    "awq-w4a16-g128": _awq(128),
    "ct-w4a16-g128-sym": _ct(4, 128, True),
    "ct-w4a16-g128-asym": _ct(4, 128, False),
    "ct-w8a16-channel-packed": _ct(8, -1, True),
    "ct-w8a16-channel-int": _ct(8, -1, True, "int-quantized"),
}
FORMAT_OF = {(4, True): "Q4_0", (4, False): "Q4_1", (8, True): "Q8_0"}


def write_checkpoint(src: str, dst, kind: str, quantize=LINEARS) -> tuple[str, dict, dict]:
    """Folder `src` quantized as CHECKPOINTS[kind] into `dst`; returns it and, per quantized weight,
    the method's own dequantized float weights W = s * (q - z), and the weights the engine's blocks
    must hold exactly (W itself, except for asymmetric 4-bit: as_q4_1)."""
    qc, writer, bits, g, sym, scale_dtype = CHECKPOINTS[kind]
    shutil.copytree(src, dst)
    tensors, reference, served = {}, {}, {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        module, _, kind_ = name.rpartition(".")
        if kind_ == "weight" and module.split(".")[-1] in quantize:
            q, z, s = rtn(w.numpy(), bits, g, sym, scale_dtype)
            reference[name] = dequantized(q, z, s)
            served[name] = as_q4_1(q, z, s) if bits == 4 and not sym else reference[name]
            for part, t in writer(q, z, s).items():
                tensors[f"{module}.{part}"] = torch.as_tensor(t)
        else:
            tensors[name] = w
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst), reference, served


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    cache = {}

    def get(arch: str) -> str:
        if arch not in cache:
            extra = {"llama": {}, "qwen2": dict(tie_word_embeddings=True)}[arch]
            cache[arch] = build_tiny_model(tmp_path_factory.mktemp(arch), model_type=arch, **SHAPE, **extra)
        return cache[arch]

    return get


def _check_loaded_weights(model, reference: dict, served: dict, kind: str) -> None:
    """The loaded blocks hold `served` exactly, and so the method's W exactly (symmetric 4-bit,
    8-bit) or within fp16's rounding of m = -s z: half an ulp, 2^-11 |s z|, plus float32's."""
    _, _, bits, g, sym, _ = CHECKPOINTS[kind]
    layer = model.model.layers["0"]
    for param, parts in ((layer.self_attn.qkv_proj, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                         (layer.mlp.down_proj, ("mlp.down_proj",))):
        assert param.quant_format.name == FORMAT_OF[(bits, sym)]
        got = param.quant_format.dequantize(param.weight).numpy()
        names = [f"model.layers.0.{p}.weight" for p in parts]
        assert np.array_equal(got, np.concatenate([served[n] for n in names]))
        w = np.concatenate([reference[n] for n in names]).astype(np.float64)
        # |s z| <= s (q - z) - s q <= |w| + 15 s; 15 s is the group's range, at most 2 max|w|.
        assert np.abs(got - w).max() <= 2.0 ** -11 * 3 * np.abs(w).max() + 2.0 ** -22 * np.abs(w).max()


@pytest.mark.parametrize("kind", sorted(CHECKPOINTS))
def test_prequantized_tokens_equal_transformers_on_the_dequantized_weights(tmp_path, folders, kind):
    folder = folders("llama")
    path, reference, served = write_checkpoint(folder, tmp_path / kind, kind)
    want = hf_tokens(write_float_folder(folder, tmp_path / "dequantized",
                                        {k: torch.from_numpy(v) for k, v in served.items()}))
    _check_loaded_weights(loaded_model(path), reference, served, kind)
    assert greedy(path) == want  # the cpu backend's C++ block kernels
    if kind in ("gptq-w4a16-g128-sym", "awq-w4a16-g128", "ct-w4a16-g128-asym"):
        assert greedy(path, attention_backend="torch") == want  # dequantize + F.linear


@pytest.mark.parametrize("kind", ["gptq-w4a16-g128-asym-v2", "ct-w4a16-g128-sym"])
def test_biases_and_tied_embeddings(tmp_path, folders, kind):
    """Qwen2: q/k/v biases stored float next to the quantized weights, the LM head tied."""
    folder = folders("qwen2")
    path, _, served = write_checkpoint(folder, tmp_path / kind, kind)
    want = hf_tokens(write_float_folder(folder, tmp_path / "dequantized",
                                        {k: torch.from_numpy(v) for k, v in served.items()}))
    assert greedy(path) == want


def test_method_flag_and_start_up_log(tmp_path, folders, caplog):
    path, _, _ = write_checkpoint(folders("llama"), tmp_path / "gptq", "gptq-w4a16-g128-sym")
    with caplog.at_level(logging.INFO):
        source = resolve_model(path, quantization="gptq")  # vLLM's spelling: read as GPTQ (detected anyway)
        assert source.quantization == "gptq"
        assert resolve_model(path).quantization == "gptq"
        model = loaded_model(path)
    assert model.model.layers["1"].mlp.gate_up_proj.quant_format.name == "Q4_0"
    assert "GPTQ (4-bit symmetric, group 128) checkpoint: 8 linear layers converted at load" in caplog.text
    assert "8 as Q4_0" in caplog.text


def test_a_quantized_lm_head_is_dequantized_with_a_log_line(tmp_path, folders, caplog):
    """GPTQ with lm_head quantized: the LM head keeps float weights here, so it is dequantized, and
    the log says so; the tokens still equal the float model's."""
    folder = folders("llama")
    path, _, served = write_checkpoint(folder, tmp_path / "gptq", "gptq-w4a16-g128-asym-v2",
                                       quantize=(*LINEARS, "lm_head"))
    with caplog.at_level(logging.WARNING):
        model = loaded_model(path)
    assert "1 quantized tensor(s) dequantized to float" in caplog.text and "lm_head" in caplog.text
    assert model.lm_head.weight.dtype == torch.float32
    assert np.array_equal(model.lm_head.weight.numpy(), served["lm_head.weight"])  # its Q4_1 blocks, dequantized
    want = hf_tokens(write_float_folder(folder, tmp_path / "dequantized",
                                        {k: torch.from_numpy(v) for k, v in served.items()}))
    assert greedy(path) == want


@pytest.mark.parametrize("kind", ["ct-w4a16-g128-asym", "ct-w8a16-channel-packed"])
def test_the_compressed_tensors_library_decompresses_the_test_checkpoint(tmp_path, folders, kind):
    """The test's compressed-tensors writer against the library's own decompressor (zero points
    packed along the output dim included): the same W, within the scales' bfloat16 arithmetic."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    qc, _, bits, g, sym, _ = CHECKPOINTS[kind]
    path, reference, _ = write_checkpoint(folders("llama"), tmp_path / "ct", kind)
    args = QuantizationArgs(**{k: v for k, v in qc["config_groups"]["group_0"]["weights"].items() if v is not None})
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for name, want in reference.items():
        module = name.removesuffix(".weight")
        parts = {p: tensors[f"{module}.{p}"] for p in ("weight_packed", "weight_scale", "weight_shape",
                                                       "weight_zero_point") if f"{module}.{p}" in tensors}
        got = PackedQuantizationCompressor.decompress(parts, scheme)["weight"].float().numpy()
        assert np.allclose(got, want, rtol=2 ** -8, atol=2 ** -8 * np.abs(want).max()), name


def test_transformers_loads_the_compressed_tensors_checkpoint(tmp_path, folders):
    """transformers (with the compressed-tensors package) decompresses the symmetric W4A16 checkpoint
    into the same weights."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    path, reference, _ = write_checkpoint(folders("llama"), tmp_path / "ct", "ct-w4a16-g128-sym")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(run_compressed=False))
    w = dict(model.named_parameters())
    for name, want in reference.items():
        # The library dequantizes in the scales' dtype (bfloat16): within its rounding.
        assert np.allclose(w[name].detach().float().numpy(), want, rtol=2 ** -8, atol=2 ** -8 * np.abs(want).max())


# ---- bad input ----

def _rewrite_config(path: str, **changes) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"].update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def test_act_order_gptq_is_refused(tmp_path, folders):
    path, _, _ = write_checkpoint(folders("llama"), tmp_path / "gptq", "gptq-w4a16-g128-sym")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = torch.from_numpy(np.random.default_rng(0).permutation(tensors[name].numpy()))
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _rewrite_config(path, desc_act=True)
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj: GPTQ act-order .*desc_act=False"):
        loaded_model(path)


@pytest.mark.parametrize("kind,changes,match", [
    ("gptq-w4a16-g128-sym", dict(bits=3), "GPTQ checkpoint with 3-bit weights: supported are 4 and 8 bits"),
    ("gptq-w4a16-g128-sym", dict(group_size=16), "group_size 16: .* multiple of 32"),
    ("gptq-w8a16-perchannel-sym", dict(sym=False), "8-bit asymmetric"),
    ("gptq-w4a16-g128-sym", dict(checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
    ("awq-w4a16-g128", dict(version="gemv"), "AWQ version 'gemv': supported is 'gemm'"),
    ("ct-w4a16-g128-sym", dict(config_groups={"g": {"targets": ["Linear"], "input_activations": {"num_bits": 8},
                                                    "weights": {"num_bits": 8, "type": "int"}}}),
     "quantizes activations too"),
    ("ct-w4a16-g128-sym", dict(format="float-quantized"), "format 'float-quantized' is not supported"),
])
def test_unsupported_schemes_are_named(tmp_path, folders, kind, changes, match):
    path, _, _ = write_checkpoint(folders("llama"), tmp_path / "q", kind)
    _rewrite_config(path, **changes)
    with pytest.raises(ValueError, match=match):
        resolve_model(path)


def test_symmetric_flag_contradicted_by_the_zero_points(tmp_path, folders):
    path, _, _ = write_checkpoint(folders("llama"), tmp_path / "gptq", "gptq-w4a16-g128-asym-v2")
    _rewrite_config(path, sym=True)
    with pytest.raises(ValueError, match="says symmetric, but zero points other than 8"):
        loaded_model(path)
