"""engine/models/cpu_fused_layers.py: a small step's decoder layers in one C++ call
(kernels/cpu_ops.cpp DecoderLayers). It calls the kernels the modules call, in their order, so the
oracle is the modules themselves: the same engine with EngineConfig.cpu_fused_layers off must give
the same tokens and the same logprobs to the last bit, over decode steps of several sequences and
prefill chunks small enough for the fused path. (The path's own oracle against transformers is
tests/engine/quant/test_gguf_native.py and test_weight_quantization.py, which now run through it.)"""

from __future__ import annotations

import os
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models import cpu_fused_layers
from engine.runner import model_runner
from kernels import cpu_build
from tests.tiny_model import build_tiny_model

pytestmark = pytest.mark.skipif(cpu_build.available() is not None, reason="the CPU kernels did not build here")

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def tiny(path, model_type: str) -> str:
    """A tiny model whose norms and biases are random too (transformers starts them at ones and
    zeros, which would let a swapped q/k norm or a dropped bias pass unseen)."""
    from safetensors.torch import load_file, save_file

    build_tiny_model(path, model_type=model_type, **SHAPE)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(11)
    for name, t in tensors.items():
        if "norm" in name or name.endswith(".bias"):
            tensors[name] = (1.0 if "norm" in name else 0.0) + 0.5 * torch.randn(t.shape, generator=gen)
    save_file(tensors, file, metadata={"format": "pt"})
    return str(path)


def run(path, prompts, **config):
    """(token ids, per-token top-3 logprobs, fused steps) of a greedy generation with chunked prefill."""
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=128,
              max_num_batched_tokens=12, enable_prefix_caching=False, **config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
        outs = llm.generate(prompts, params, use_tqdm=False)
        fused = llm.engine.runner.model.model.fused_layers
        steps = fused.steps if fused is not None else 0
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[sorted(d.items()) for d in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs, steps


@pytest.mark.parametrize("model_type, quantization, kv_cache_dtype, unpack", [
    ("llama", "int8", "auto", False), ("llama", "int4", "auto", False), ("llama", "int4", "fp8", False),
    ("llama", "int4", "bfloat16", False), ("qwen3", None, "float16", False),  # 16-bit caches under float32
    ("qwen2", "int8", "auto", False),  # the qkv bias, added after the block matmul
    ("qwen3", "int4", "auto", False),  # the q/k norms
    ("llama", None, "auto", False),  # float weights: oneDNN's packed matmul where it packs them
    ("qwen2", None, "auto", True),  # float weights through F.linear, the bias inside it
])
def test_fused_layers_compute_what_the_modules_compute(tmp_path, monkeypatch, model_type, quantization,
                                                      kv_cache_dtype, unpack):
    if unpack:  # float weights left plain (F.linear), as where oneDNN cannot pack them
        monkeypatch.setattr(model_runner, "pack_weights", lambda model, pack, pack_blocks: None)
    path = tiny(tmp_path / "tiny", model_type)
    rng = random.Random(7)
    # Three sequences decoding together; prompts of 1 to 30 tokens, chunked by 12 a step (rows <= 16).
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30)]
    config = dict(quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                  **(dict(quantization_group_size=32) if quantization == "int4" else {}))
    tokens, logprobs, steps = run(path, prompts, **config)
    assert steps > 10, "the fused path was not taken"
    want_tokens, want_logprobs, modules_steps = run(path, prompts, cpu_fused_layers=False, **config)
    assert modules_steps == 0
    assert tokens == want_tokens
    assert logprobs == want_logprobs  # exact: the same kernels on the same tensors


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_16_bit_cache_gives_the_reference_backends_tokens(tmp_path, kv_cache_dtype):
    """A 16-bit KV cache under a float32 model: the cpu backend's C++ write and attention (the fused
    layers at decode) against the torch backend, which stores and reads the same rounded cache through
    kernels/reference.py."""
    path = tiny(tmp_path / "tiny", "llama")
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30)]
    tokens, _, steps = run(path, prompts, kv_cache_dtype=kv_cache_dtype)
    assert steps > 10, "the fused path was not taken"
    want, _, _ = run(path, prompts, kv_cache_dtype=kv_cache_dtype, attention_backend="torch")
    assert tokens == want


def test_steps_above_the_register_rows_run_the_modules(tmp_path):
    """A 40-token prefill in one step is past the register kernel's rows: the modules take it, and
    the later decode steps take the fused path; the tokens are the modules' throughout."""
    path = build_tiny_model(tmp_path / "tiny", **SHAPE)
    prompts = [list(range(3, 43))]
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=128,
              quantization="int8", enable_prefix_caching=False)
    try:
        inner = llm.engine.runner.model.model
        fused, calls = inner.fused_layers, []

        def recorded(rope, hidden, residual):  # the model calls whatever fused_layers holds
            out = fused(rope, hidden, residual)
            calls.append((hidden.shape[0], out is not None))
            return out

        inner.fused_layers = recorded
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert calls == [(40, False), (1, True), (1, True), (1, True)]
    want, _, _ = run(path, prompts, quantization="int8", cpu_fused_layers=False)
    assert outs[0].outputs[0].token_ids == want[0][:4]


@pytest.mark.parametrize("model_type, config, why", [
    ("mixtral", dict(quantization="int8", num_local_experts=4, num_experts_per_tok=2), "layer type"),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), "layer type"),
])
def test_models_it_does_not_cover_run_the_modules(tmp_path, model_type, config, why):
    config = dict(config)  # the parametrized dict is shared: pop from a copy
    shape = {k: config.pop(k) for k in ("num_local_experts", "num_experts_per_tok") if k in config}
    path = build_tiny_model(tmp_path / "tiny", model_type=model_type, **SHAPE, **shape)
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64, **config)
    try:
        inner = llm.engine.runner.model.model
        assert inner.fused_layers is None
        assert why in cpu_fused_layers.unsupported(inner)
    finally:
        llm.shutdown()
