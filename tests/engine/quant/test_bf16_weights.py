"""A checkpoint's bfloat16 matrices kept as stored under a float32 model on the cpu backend
(EngineConfig.cpu_bf16_weights, engine.quant.BF16), against transformers' float32 greedy tokens on the
same checkpoint (it widens the bf16 values exactly, as the C++ kernels do), from a safetensors folder
and from a BF16 .gguf file of the same weights."""

from __future__ import annotations

import pytest
import torch

import kernels
from engine.layers.context import forward_context
from tests.engine.engine_runs import engine_greedy, loaded_model
from tests.engine.hf_oracle import hf_greedy
from tests.engine.quant.test_gguf_native import write_gguf
from tests.tiny_model import build_tiny_model

# A prompt past 16 tokens takes the tiled kernel (prefill), the others and every decode step the
# register kernel inside the fused decode layers.
PROMPTS = [[5, 9, 33, 100, 7], list(range(3, 45)), [77], [200, 201, 202, 203] * 5]
MAX_TOKENS = 16


def saved_in_bf16(tmp_path_factory, name: str, **overrides) -> str:
    """A tiny random model (build_tiny_model's `overrides`) saved again in bfloat16, with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fp32 = build_tiny_model(tmp_path_factory.mktemp(f"{name}32"), **overrides)
    folder = tmp_path_factory.mktemp(f"{name}16")
    AutoModelForCausalLM.from_pretrained(fp32, dtype=torch.float32).to(torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(fp32).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def bf16_folder(tmp_path_factory):
    """A tiny Llama saved in bfloat16: tied embeddings (the LM head reads the embedding's bf16 blocks),
    intermediate 80, so down_proj's inputs are not whole blocks of 32 and it stays float32."""
    return saved_in_bf16(tmp_path_factory, "llama", model_type="llama", tie_word_embeddings=True,
                         intermediate_size=80)


def test_bf16_matrices_are_held_as_stored(bf16_folder):
    """The linear layers whose inputs are whole blocks, the embedding and the tied LM head hold the
    checkpoint's bf16 bytes; down_proj (80 inputs) and the norms are float32; every weight equals
    the float32 load's."""
    model, floats = loaded_model(bf16_folder, keep_bf16=True), loaded_model(bf16_folder)
    layer, float_layer = model.model.layers["0"], floats.model.layers["0"]
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj"):
        m = layer.get_submodule(name)
        assert m.quant_format.name == "BF16" and m.weight.dtype == torch.uint8, name
        assert torch.equal(m.quant_format.dequantize(m.weight), float_layer.get_submodule(name).weight), name
    assert layer.mlp.down_proj.quant_format is None and layer.mlp.down_proj.weight.dtype == torch.float32
    assert torch.equal(layer.mlp.down_proj.weight, float_layer.mlp.down_proj.weight)
    embed = model.model.embed_tokens
    assert embed.quant_format.name == "BF16" and model.lm_head.weight is embed.weight
    ids = torch.tensor([[0, 5, 7], [model.config.vocab_size - 1, 3, 3]])
    for backend in ("torch", "cpu"):
        with forward_context(None, kernels.get_backend(backend)):
            assert torch.equal(embed(ids), floats.model.embed_tokens(ids)), backend
    assert embed.weight.numel() == 2 * floats.model.embed_tokens.weight.numel()  # bytes: half of float32's
    assert floats.model.layers["0"].self_attn.qkv_proj.quant_format is None


def test_bf16_folder_generates_transformers_tokens(bf16_folder):
    want = [hf_greedy(bf16_folder, p, MAX_TOKENS) for p in PROMPTS]
    assert engine_greedy(bf16_folder, PROMPTS, MAX_TOKENS, num_kv_blocks=64, max_model_len=256) == want


def test_bf16_gguf_generates_transformers_tokens(tmp_path, bf16_folder):
    """A BF16 .gguf of the same weights: its matrices stay bf16 too (a GGUF float type, which the
    GGUF path alone would convert to float32), and the tokens are transformers'."""
    path = tmp_path / "bf16.gguf"
    write_gguf(path, bf16_folder, "llama", "BF16")
    model = loaded_model(path, keep_bf16=True)
    assert model.model.layers["1"].self_attn.qkv_proj.quant_format.name == "BF16"
    assert model.model.embed_tokens.quant_format.name == "BF16"
    want = [hf_greedy(bf16_folder, p, MAX_TOKENS) for p in PROMPTS]
    assert engine_greedy(path, PROMPTS, MAX_TOKENS, tokenizer=bf16_folder, num_kv_blocks=64,
                         max_model_len=256) == want


def test_engine_knob_reaches_the_loader(bf16_folder):
    """cpu_bf16_weights=False converts the matrices to float32 at load; a bfloat16 model (--dtype)
    keeps them as blocks except where oneDNN has its bf16 brgemm (AMX), which holds bf16 weights of
    its own; "auto" is a bfloat16 model for this bf16 checkpoint where the CPU has native bf16
    matmuls, a float32 one where not."""
    from engine import LLM

    from kernels.cpu_ops import native_bf16_matmul
    from kernels.cpu_quant import has_brgemm_bf16

    without_brgemm = not has_brgemm_bf16()
    auto = torch.bfloat16 if native_bf16_matmul() else torch.float32
    for config, kept, dtype in (({"dtype": "float32"}, True, torch.float32),
                                ({"dtype": "float32", "cpu_bf16_weights": False}, False, torch.float32),
                                ({"dtype": "bfloat16"}, without_brgemm, torch.bfloat16),
                                ({"dtype": "bfloat16", "cpu_bf16_weights": False}, False, torch.bfloat16),
                                ({}, without_brgemm, auto)):
        llm = LLM(bf16_folder, device="cpu", num_kv_blocks=16, max_model_len=128, **config)
        try:
            assert llm.engine.runner.dtype == dtype, config
            layer = llm.engine.runner.model.model.layers["0"]
            assert (layer.self_attn.qkv_proj.quant_format is not None) == kept, config
        finally:
            llm.shutdown()


@pytest.fixture(scope="module")
def bf16_mixtral(tmp_path_factory):
    """A tiny Mixtral saved in bfloat16 whose experts are whole blocks of 32 (hidden 64, ffn 64)."""
    return saved_in_bf16(tmp_path_factory, "mixtral", model_type="mixtral", num_attention_heads=4,
                         num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, intermediate_size=64)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_bfloat16_model_without_native_bf16_keeps_blocks(family, bf16_folder, bf16_mixtral):
    """A bfloat16 model on a CPU without native bf16 matmuls (AVX2) keeps the checkpoint's matrices,
    and its experts (the fused MoE's blocks layout), as stored and widens them in the block kernels,
    prompt rows past 16 included (the float32 tiled kernel): its first tokens and logprobs stay
    those of transformers in bfloat16."""
    from transformers import AutoModelForCausalLM

    from engine import LLM
    from engine.layers.moe import FusedMoE
    from kernels.cpu_ops import native_bf16_matmul
    from tests.engine.hf_oracle import assert_first_tokens_close

    if native_bf16_matmul():
        pytest.skip("this CPU multiplies bf16 natively (test_bfloat16_model_with_native_bf16_keeps_blocks)")
    path = bf16_folder if family == "llama" else bf16_mixtral
    llm = LLM(path, device="cpu", dtype="bfloat16", num_kv_blocks=64, max_model_len=256)
    try:
        model = llm.engine.runner.model
        assert model.model.layers["0"].self_attn.qkv_proj.quant_format.name == "BF16"
        experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
        assert all(m.packed.layout == "blocks" for m in experts) and len(experts) == (family == "mixtral") * 2
        # Mixtral: transformers' eager loop over experts (its grouped GEMM wants 16-byte row strides).
        extra = {"experts_implementation": "eager"} if family == "mixtral" else {}
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **extra).eval()
        assert_first_tokens_close(llm, hf, PROMPTS + [list(range(100, 140)), list(range(7, 70, 2))])
    finally:
        llm.shutdown()


def test_bfloat16_model_with_native_bf16_keeps_blocks(bf16_folder):
    """A bfloat16 model on a CPU with native bf16 matmuls but no AMX (Zen 4/5) keeps the checkpoint's
    matrices as stored too: up to 16 rows (the fused layers' steps) take the bf16 dot kernel on them,
    17-64 the outer-product one (kernels/cpu_quant.cpp); the tied LM head reads the embedding's blocks
    (the vocabulary held once, no oneDNN copy). One sequence a step (max_num_seqs=1), so prompts of 1,
    2 and 5 tokens are steps of that many rows, of 20, 40 and 42 the outer kernel's.
    First tokens and logprobs stay those of transformers in bfloat16."""
    from transformers import AutoModelForCausalLM

    from engine import LLM
    from kernels.cpu_ops import native_bf16_matmul
    from kernels.cpu_quant import has_brgemm_bf16
    from tests.engine.hf_oracle import assert_first_tokens_close

    if not native_bf16_matmul() or has_brgemm_bf16():
        pytest.skip("for CPUs with native bf16 matmuls and no bf16 brgemm (AVX512_BF16 without AMX)")
    llm = LLM(bf16_folder, device="cpu", dtype="bfloat16", num_kv_blocks=64, max_model_len=256, max_num_seqs=1)
    try:
        model = llm.engine.runner.model
        assert model.model.layers["0"].self_attn.qkv_proj.quant_format.name == "BF16"
        assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.packed_weight is None
        hf = AutoModelForCausalLM.from_pretrained(bf16_folder, dtype=torch.bfloat16).eval()
        assert_first_tokens_close(llm, hf, PROMPTS + [[31, 32], list(range(100, 140))])
        assert model.model.fused_layers.steps >= 3  # the 1-, 2- and 5-token prompts
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tensor_parallel_ranks_slice_the_bf16_blocks(bf16_folder):
    """Two ranks (gloo processes): each holds its rows (qkv, gate_up, the vocabulary) or its whole
    blocks of inputs (o_proj: 32 a rank) as bf16; down_proj's 40 inputs a rank are not whole blocks and
    stay float32. The tokens are still transformers'."""
    want = [hf_greedy(bf16_folder, p, MAX_TOKENS) for p in PROMPTS]
    assert engine_greedy(bf16_folder, PROMPTS, MAX_TOKENS, num_kv_blocks=64, max_model_len=256,
                         tensor_parallel_size=2) == want
