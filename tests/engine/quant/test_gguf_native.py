"""GGUF weights served as stored (engine/quant + kernels/cpu_quant.cpp) against the same weights
served dequantized to float, the path every GGUF took before: a tiny random model written to
GGUF with gguf's writer, its matrices quantized with gguf.quants.quantize (Q4_K and Q6_K, which
gguf cannot quantize: tests/kernels/gguf_blocks.py). The dequantized twin is the same file loaded
with gguf_weights="dequantize", or a float32 GGUF holding gguf.quants.dequantize of those very
blocks, which is exactly what the dequantizing path loads from the quantized file."""

from __future__ import annotations

import logging
import os

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from safetensors.torch import load_file
from transformers import AutoConfig

import kernels
from engine.layers.context import forward_context
from kernels import cpu_quant
from tests.engine.engine_runs import engine_greedy, loaded_model
from tests.kernels.gguf_blocks import quantize
from tests.tiny_model import build_tiny_model

PROMPTS = [[5, 9, 33, 100, 7], list(range(3, 60)), [77], [200, 201, 202, 203] * 5, [11, 300, 12, 301],
           list(range(400, 440, 3)), [42] * 9, [1, 2, 3, 4, 5, 6, 7, 8]]
MAX_TOKENS = 24


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, folder: str, arch: str, qtype: str | None, as_float: bool = False,
               override: dict[str, str] | None = None) -> None:
    """The folder's model as a GGUF whose matrices are `qtype` blocks (norms and biases F32);
    as_float: the same blocks dequantized, stored F32. `override`: GGUF name -> another type."""
    c = AutoConfig.from_pretrained(folder)
    w = gguf.GGUFWriter(str(path), arch)
    for add, value in ((w.add_block_count, c.num_hidden_layers), (w.add_context_length, c.max_position_embeddings),
                       (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_rope_freq_base, c.rope_theta if hasattr(c, "rope_theta") else 10000.0),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps)):
        add(value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    for hf_name, t in load_file(os.path.join(folder, "model.safetensors")).items():
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        data = t.float().numpy()
        if arch == "llama" and ".q_proj." in hf_name:
            data = _permute(data, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            data = _permute(data, c.num_key_value_heads)
        kind = (override or {}).get(gguf_name, qtype)
        if data.ndim == 2 and kind is not None:
            qt = gguf.GGMLQuantizationType[kind]
            blocks = quantize(np.ascontiguousarray(data), kind)
            if as_float:
                w.add_tensor(gguf_name, np.ascontiguousarray(dequantize(blocks, qt), dtype=np.float32))
            else:
                w.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=qt)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def greedy(path, folder: str, **config) -> list[list[int]]:
    return engine_greedy(path, PROMPTS, MAX_TOKENS, tokenizer=folder, num_kv_blocks=128, max_model_len=256, **config)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of generated positions where both chose the same token (greedy streams diverge after a
    first difference, so this is a lower bound on per-position agreement)."""
    same = sum(x == y for sa, sb in zip(a, b) for x, y in zip(sa, sb))
    return same / sum(len(s) for s in a)


def forced_agreement(path, folder: str, want: list[list[int]], **config) -> float:
    """Share of the reference's generated positions where this model's greedy choice, given the
    reference's own prefix (teacher forcing, through prompt_logprobs), is the reference's token."""
    from engine import LLM, SamplingParams

    llm = LLM(str(path), tokenizer=folder, device="cpu", num_kv_blocks=128, max_model_len=256, **config)
    try:
        outs = llm.generate([p + w for p, w in zip(PROMPTS, want)],
                            SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    finally:
        llm.shutdown()
    same = total = 0
    for prompt, tokens, out in zip(PROMPTS, want, outs):
        for j, token in enumerate(tokens):
            position = out.prompt_logprobs[len(prompt) + j]
            same += max(position, key=position.get) == token
            total += 1
    return same / total


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folders = {}

    def get(arch: str, wide: bool = False) -> str:
        """wide: hidden 256, intermediate 512, so every matrix's rows are whole K-quant super-blocks."""
        if (arch, wide) not in folders:
            overrides = {"llama": dict(num_attention_heads=4, num_key_value_heads=2),
                         "qwen2": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)}[arch]
            if wide:
                overrides.update(hidden_size=256, intermediate_size=512)
            folders[arch, wide] = build_tiny_model(tmp_path_factory.mktemp(arch), model_type=arch, **overrides)
        return folders[arch, wide]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # llama: q/k rows permuted as blocks; qwen2: biases, tied
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_native_gguf_generates_the_dequantized_tokens(tmp_path, tiny, arch, qtype):
    folder = tiny(arch)
    native, floats = tmp_path / "native.gguf", tmp_path / "floats.gguf"
    write_gguf(native, folder, arch, qtype)
    write_gguf(floats, folder, arch, qtype, as_float=True)
    want = greedy(floats, folder, dtype="float32")
    # float activations: the kernels differ from the float matmul in summation order only.
    exact = greedy(native, folder, dtype="float32", cpu_gguf_activations="float")
    assert agreement(exact, want) >= (1.0 if qtype == "Q8_0" else 0.95)
    # Integer activations, each position's choice on the reference's prefix, scored in 16-token
    # chunks so every row takes the small-step kernels: int16 (the default) rounds 256x finer than
    # int8 and keeps the float choices; int8 (llama.cpp's) flips more of a random tiny model's
    # nearly flat logits than a trained model's (93-95% here); a wrong kernel or scale agrees on
    # almost none.
    for kind, floor in (("int16", 0.99), ("int8", 0.9)):
        if cpu_quant.takes_activations(qtype, kind):
            assert forced_agreement(native, folder, want, dtype="float32", max_num_batched_tokens=16,
                                    cpu_gguf_activations=kind) >= floor, kind
    # The torch backend multiplies by dequantize-then-F.linear: the float path's own numbers.
    assert greedy(native, folder, dtype="float32", attention_backend="torch") == want
    # bfloat16: the float path rounds the weights to bfloat16, the kernels do not; one flipped token
    # sends two free-running streams apart, so compare each position on the same prefix.
    assert forced_agreement(native, folder, greedy(floats, folder, dtype="bfloat16"), dtype="bfloat16") >= 0.95


def test_the_runner_tells_the_thread_follower_where_the_matmuls_run(tmp_path, tiny):
    """Helpers on shared CPUs join the C++ kernels' loops: the follower uses them for a GGUF's block
    matmuls, not for a float model's, whose GEMMs are torch's team's (engine/runner/cpu_threads.py)."""
    from engine import LLM

    folder = tiny("llama")
    path = tmp_path / "model.gguf"
    write_gguf(path, folder, "llama", "Q4_1")
    for model, kernel_matmuls in ((path, True), (folder, False)):
        llm = LLM(str(model), tokenizer=folder, device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64)
        try:
            assert llm.engine.runner.threads.kernel_matmuls is kernel_matmuls, model
        finally:
            llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_kernel_helpers_generate_the_teams_tokens(tmp_path, tiny, arch):
    """On CPUs that other processes keep busy the load follower runs torch on one thread and the C++
    kernels' loops on it plus helpers (cpu_build.set_helpers): the numbers of torch's team of two,
    so its tokens, in bfloat16 (prompts past 16 rows take the dequantized GEMM, in slices per
    thread with helpers) and float32; qwen2's qkv biases and tied head included."""
    from kernels import cpu_build

    folder = tiny(arch)
    path = tmp_path / "model.gguf"
    write_gguf(path, folder, arch, "Q4_1", override={"token_embd.weight": "Q8_0"})
    for dtype in ("bfloat16", "float32"):
        want = greedy(path, folder, dtype=dtype, num_threads=2)
        cpu_build.set_helpers(1)
        try:
            got = greedy(path, folder, dtype=dtype, num_threads=1)
        finally:
            cpu_build.set_helpers(0)
        assert got == want, dtype


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_native_k_quant_gguf_generates_the_dequantized_tokens(tmp_path, tiny, arch, qtype):
    """K-quants (super-blocks of 256) served as stored give the tokens of the same file loaded with
    gguf_weights="dequantize"."""
    folder = tiny(arch, wide=True)
    path = tmp_path / f"{qtype}.gguf"
    write_gguf(path, folder, arch, qtype)
    model = loaded_model(path)
    assert model.model.layers["1"].mlp.down_proj.quant_format.name == qtype
    want = greedy(path, folder, dtype="float32", gguf_weights="dequantize")
    # float32: the kernels differ from the float matmul in summation order only.
    assert greedy(path, folder, dtype="float32") == want
    assert greedy(path, folder, dtype="float32", attention_backend="torch") == want
    # bfloat16 activations flip a few of float32's choices on a random tiny model's nearly flat
    # logits (92-98% agree, and the dequantized path, which also rounds the weights to bfloat16,
    # agrees less: 92-96%); a wrong kernel agrees on almost none. Each position on float32's prefix.
    assert forced_agreement(path, folder, want, dtype="bfloat16") >= 0.9


def test_q4_k_m_style_mix(tmp_path, tiny, caplog):
    """llama.cpp's Q4_K_M recipe mixes Q4_K and Q6_K tensors: each layer whose tensors share one
    type keeps it (the LM head its Q6_K); a merged layer whose parts differ (here layer 0's q/k Q4_K,
    v Q6_K) is served from float weights, said so in the log; the tokens are the dequantized file's."""
    folder = tiny("llama", wide=True)
    path = tmp_path / "q4_k_m.gguf"
    six = {"output.weight", "blk.0.attn_v.weight", "blk.0.ffn_down.weight", "blk.1.ffn_down.weight"}
    write_gguf(path, folder, "llama", "Q4_K", override=dict.fromkeys(six, "Q6_K"))
    with caplog.at_level(logging.INFO, logger="engine.loading.weights"):
        model = loaded_model(path)
    layers = model.model.layers
    assert layers["0"].self_attn.qkv_proj.quant_format is None
    assert "blk.0.attn_q.weight (Q4_K, its layer mixes types)" in caplog.text
    assert layers["1"].self_attn.qkv_proj.quant_format.name == "Q4_K"
    assert layers["0"].mlp.gate_up_proj.quant_format.name == "Q4_K"
    assert layers["1"].mlp.down_proj.quant_format.name == "Q6_K"
    assert model.lm_head.quant_format.name == "Q6_K" and "output.weight" not in caplog.text
    assert greedy(path, folder, dtype="float32") == greedy(path, folder, dtype="float32", gguf_weights="dequantize")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: tied embeddings
def test_linear_layers_embedding_and_lm_head_hold_blocks(tmp_path, tiny, caplog, arch):
    """Every matrix stays as stored: the linear layers, the embedding (a lookup dequantizes only the
    rows it reads) and the LM head, which with tied embeddings is the embedding's own blocks."""
    folder = tiny(arch)
    path = tmp_path / "q.gguf"
    write_gguf(path, folder, arch, "Q4_1", override={"token_embd.weight": "Q8_0"})
    with caplog.at_level(logging.INFO, logger="engine.loading.weights"):
        model = loaded_model(path)
    layer = model.model.layers["0"]
    assert layer.self_attn.qkv_proj.quant_format.name == "Q4_1"
    assert layer.self_attn.qkv_proj.weight.dtype == torch.uint8
    assert layer.mlp.down_proj.quant_format.name == "Q4_1"
    embed = model.model.embed_tokens
    assert embed.quant_format.name == "Q8_0" and embed.weight.dtype == torch.uint8
    if arch == "qwen2":
        assert model.lm_head.weight is embed.weight and model.lm_head.quant_format is embed.quant_format
    else:
        assert model.lm_head.quant_format.name == "Q4_1"
    assert "dequantized" not in caplog.text

    floats = loaded_model(path, gguf_weights="dequantize")
    assert floats.model.layers["0"].self_attn.qkv_proj.quant_format is None
    w = floats.model.layers["0"].self_attn.qkv_proj.weight
    assert torch.equal(layer.self_attn.qkv_proj.quant_format.dequantize(layer.self_attn.qkv_proj.weight), w)
    ids = torch.tensor([[0, 5, 7], [model.config.vocab_size - 1, 3, 3]])
    for backend in ("torch", "cpu"):  # the rows dequantized by torch ops, and by the C++ kernel
        with forward_context(None, kernels.get_backend(backend)):
            assert torch.equal(embed(ids), floats.model.embed_tokens(ids)), backend  # gguf's values, row by row
    assert torch.equal(model.lm_head.quant_format.dequantize(model.lm_head.weight), floats.lm_head.weight)


def test_mixed_types_in_one_layer_are_dequantized_with_a_log_line(tmp_path, tiny, caplog):
    folder = tiny("llama")
    path = tmp_path / "mixed.gguf"
    write_gguf(path, folder, "llama", "Q4_0", override={"blk.0.attn_v.weight": "Q8_0"})
    with caplog.at_level(logging.INFO, logger="engine.loading.weights"):
        model = loaded_model(path)
    assert model.model.layers["0"].self_attn.qkv_proj.quant_format is None
    assert model.model.layers["1"].self_attn.qkv_proj.quant_format.name == "Q4_0"
    assert "mixes types" in caplog.text


def test_a_type_without_a_native_kernel_is_dequantized_and_said_so(tmp_path, tiny, caplog):
    """Q5_0 (and Q5_K, ...) has no kernel here yet: that layer is served from float weights, as
    every GGUF was before, with a warning naming the tensor; the others stay blocks."""
    folder = tiny("llama")
    path = tmp_path / "q5.gguf"
    write_gguf(path, folder, "llama", "Q4_0", override={"blk.1.ffn_down.weight": "Q5_0"})
    with caplog.at_level(logging.WARNING, logger="engine.loading.weights"):
        model = loaded_model(path)
    assert model.model.layers["1"].mlp.down_proj.quant_format is None
    assert model.model.layers["1"].mlp.gate_up_proj.quant_format.name == "Q4_0"
    assert "blk.1.ffn_down.weight (Q5_0, no native kernel for it yet)" in caplog.text


def test_engine_knob_reaches_the_loader(tmp_path, tiny):
    """`--gguf-weights dequantize` (EngineConfig.gguf_weights) serves the same file from float weights;
    a value that is neither is refused naming the field."""
    from engine import LLM

    folder = tiny("llama")
    path = tmp_path / "q4.gguf"
    write_gguf(path, folder, "llama", "Q4_0")
    for choice, native in (("native", True), ("dequantize", False)):
        llm = LLM(str(path), tokenizer=folder, device="cpu", gguf_weights=choice, num_kv_blocks=16, max_model_len=128)
        layer = llm.engine.runner.model.model.layers["0"]
        assert (layer.mlp.down_proj.quant_format is not None) == native
    with pytest.raises(ValueError, match="gguf_weights must be one of"):
        LLM(str(path), tokenizer=folder, device="cpu", gguf_weights="int4")


@pytest.mark.parametrize("kind", ["int16", "int8", "float"])
def test_each_activation_kind_marks_the_matmuls_it_pays_for(tmp_path, tiny, caplog, kind):
    """cpu_gguf_activations marks the block matmuls (linear layers and LM head, not the embedding
    lookup) whose format has that kind's kernel on this build, says so in the log, and the fused
    layers hand C++ the same kernel."""
    from engine import LLM
    from engine.models.cpu_fused_layers import ACTIVATION_CODES, _format

    folder = tiny("qwen2")  # tied: the LM head is the embedding's Q8_0 blocks
    path = tmp_path / "mix.gguf"
    write_gguf(path, folder, "qwen2", "Q4_1", override={"token_embd.weight": "Q8_0"})
    with caplog.at_level(logging.INFO, logger="engine.quant.activations"):
        llm = LLM(str(path), tokenizer=folder, device="cpu", num_kv_blocks=32, max_model_len=128,
                  cpu_gguf_activations=kind)
    model = llm.engine.runner.model
    want = {f: kind if kind != "float" and cpu_quant.takes_activations(f, kind) else None for f in ("Q4_1", "Q8_0")}
    layer = model.model.layers["0"]
    for m in (layer.self_attn.qkv_proj, layer.mlp.down_proj, model.lm_head):
        assert m.activations == want[m.quant_format.name], (m, m.quant_format.name)
        if m is not model.lm_head:
            assert _format(m) == cpu_quant.FORMATS[m.quant_format.name].id + ACTIVATION_CODES[m.activations]
    assert not hasattr(model.model.embed_tokens, "activations")
    said = " ".join(r.getMessage() for r in caplog.records)
    assert (f"{kind} activations for the" in said) == any(want.values())
    llm.shutdown()
