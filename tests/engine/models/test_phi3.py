"""Phi-3 / Phi-4-mini (engine/models/phi3.py) against transformers: fused qkv_proj and gate_up_proj
checkpoints, partial rotary embeddings and LongRoPE, greedy token for token in float32 on tiny random
models, chunked, preempted and with a prefix-cache hit."""

from __future__ import annotations

import math
import os
import random
import shutil

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.support import UnsupportedModelError, check_supported
from tests.engine.hf_oracle import hf_greedy
from tests.engine.models.test_rope_scaling import ORIGINAL, _generate_and_compare
from tests.tiny_model import build_tokenizer

if not torch.cuda.is_available():
    # The triton case runs its kernels under Triton's interpreter, as tests/kernels does; the choice is
    # read when kernels/triton_*.py are first imported (the engine imports them lazily).
    os.environ.setdefault("TRITON_INTERPRET", "1")

HEAD_DIM = 16


def _longrope(partial: float) -> dict:
    pairs = int(HEAD_DIM * partial) // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
            "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
            "long_factor": [1.5 + 0.4 * i for i in range(pairs)]}


# name -> Phi3Config fields: Phi-3-mini-4k's plain rope; partial rotary alone; Phi-4-mini's form (3/4 of each
# head rotated, LongRoPE past an original length, tied embeddings, more query heads per KV head), served
# past its original length (long factors) and within it (short factors, a table no longer than the original).
MODELS = {
    "plain": dict(max_position_embeddings=128),
    "partial": dict(max_position_embeddings=128, partial_rotary_factor=0.5),
    "phi4-mini-long": dict(max_position_embeddings=128, original_max_position_embeddings=ORIGINAL,
                           rope_parameters=_longrope(0.75), partial_rotary_factor=0.75, tie_word_embeddings=True,
                           hidden_size=128),
    "phi4-mini-short": dict(max_position_embeddings=ORIGINAL, original_max_position_embeddings=ORIGINAL,
                            rope_parameters=_longrope(0.75), partial_rotary_factor=0.75),
}


def build_tiny_phi3(path, seed: int = 0, **fields) -> str:
    """A random float32 Phi3ForCausalLM (as transformers writes it: fused qkv_proj, gate_up_proj) and the
    test tokenizer, in `path`."""
    import transformers

    tokenizer = build_tokenizer()
    args = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, sliding_window=None, initializer_range=0.2,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, dtype="float32")
    args.update(fields)
    args["num_attention_heads"] = args["hidden_size"] // HEAD_DIM
    config = transformers.Phi3Config(**args)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def phi3_models(tmp_path_factory):
    cache = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = build_tiny_phi3(tmp_path_factory.mktemp(name), **MODELS[name])
        return cache[name]

    return get


@pytest.mark.parametrize("name, backend", [("plain", "cpu"), ("partial", "cpu"), ("phi4-mini-long", "cpu"),
                                           ("partial", "torch"),
                                           pytest.param("phi4-mini-long", "triton", marks=pytest.mark.slow)])
def test_greedy_matches_transformers(name, backend, phi3_models):
    """Prompts past the original length (the long factors in transformers too), 32-token chunks, preemption,
    a prefix-cache hit."""
    _generate_and_compare(phi3_models(name), backend, [40, 100])


@pytest.mark.parametrize("name, seed", [("phi4-mini-short", 1), ("phi4-mini-long", 2)])
def test_longrope_short_factors_within_the_original_length(name, seed, phi3_models):
    """A table no longer than the original length takes the short factors, as transformers does for every
    sequence within it: a model whose own length is the original one, and a long-context model served
    with --max-model-len within its original length (the table sized by max_model_len, as vLLM sizes it)."""
    path = phi3_models(name)
    llm = LLM(path, device="cpu", num_kv_blocks=16, block_size=16, max_model_len=ORIGINAL, seed=0)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, llm.engine.vocab_size) for _ in range(n)] for n in (3, 24)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 6) for p in prompts]


def test_fused_tensors_split_into_rows_of_each_part_in_rotary_order():
    """q, k and v rows of a fused qkv_proj (float and quantized blocks alike) go to their parts; under partial
    rotary each head's q/k rows are reordered so the kernels' pairs (i, i + 8) are transformers' (i, i + 4)."""
    import transformers

    from engine.models.phi3 import Phi3ForCausalLM
    from engine.quant.quantize import quantize

    def parts(partial: float, name: str, tensor) -> dict:
        cfg = transformers.Phi3Config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                      num_hidden_layers=1, vocab_size=16, pad_token_id=0, partial_rotary_factor=partial)
        return dict(Phi3ForCausalLM(cfg, max_positions=8).checkpoint_parts(name, tensor))

    qkv = torch.arange(64, dtype=torch.float32)[:, None].expand(64, 64).contiguous()  # row i holds i
    full = parts(1.0, "l.self_attn.qkv_proj.weight", qkv)
    assert [full[f"l.self_attn.{p}_proj.weight"][:, 0].tolist() for p in "qkv"] == \
        [list(range(32)), list(range(32, 48)), list(range(48, 64))]
    # A head's 16 rows: rotated pairs (0, 4) .. (3, 7), then 8..15 unrotated; now 0-3 | 8-11 | 4-7 | 12-15.
    head = [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
    split = parts(0.5, "l.self_attn.qkv_proj.weight", qkv)
    assert split["l.self_attn.q_proj.weight"][:, 0].tolist() == head + [16 + i for i in head]
    assert split["l.self_attn.k_proj.weight"][:, 0].tolist() == [32 + i for i in head]
    assert split["l.self_attn.v_proj.weight"][:, 0].tolist() == list(range(48, 64))  # values never rotate
    quantized = quantize(qkv, "int8")
    blocks = parts(0.5, "l.self_attn.qkv_proj.weight", quantized)
    assert torch.equal(blocks["l.self_attn.k_proj.weight"].dequantize(), quantized.dequantize()[[32 + i for i in head]])
    up = parts(0.5, "l.mlp.gate_up_proj.weight", qkv)
    assert up["l.mlp.gate_proj.weight"][:, 0].tolist() == list(range(32))
    assert up["l.mlp.up_proj.weight"][:, 0].tolist() == list(range(32, 64))


@pytest.mark.parametrize("config", [
    # microsoft/Phi-3-mini-128k-instruct's first config.json named LongRoPE "su" (factors shortened here)
    {"model_type": "phi3", "rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]},
     "original_max_position_embeddings": 4096},
    # microsoft/Phi-4-mini-instruct's config.json: 3/4 of each head rotated, LongRoPE
    {"model_type": "phi3", "partial_rotary_factor": 0.75, "rope_scaling": {"type": "longrope"}},
])
def test_phi3_configs_pass_the_support_check(config):
    check_supported(config)


def test_partial_rotary_stays_refused_for_families_without_it():
    """transformers 5 saves the factor in rope_parameters; a Llama with it is still refused (its layout here
    rotates whole heads)."""
    with pytest.raises(UnsupportedModelError, match="partial rotary embeddings"):
        check_supported({"model_type": "llama",
                         "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}})


def _write_phi3_gguf(path, folder: str, kind: str = "F32") -> None:
    """A Phi-3 folder as llama.cpp's converter writes it (convert_hf_to_gguf.py, Phi3MiniModel): fused
    attn_qkv and ffn_up, rope.dimension_count for the rotated share, LongRoPE factors as two tensors;
    `kind` Q8_0 stores the matrices as Q8_0 blocks (gguf-py's own quantizer)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(folder)
    rope = c.rope_parameters
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_context_length(c.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * c.hidden_size) // c.num_attention_heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, c.num_hidden_layers)
    for hf_name, t in load_file(f"{folder}/model.safetensors").items():
        base, suffix = hf_name.rsplit(".", 1)
        data = np.ascontiguousarray(t.numpy())
        if kind == "Q8_0" and data.ndim == 2 and "embed_tokens" not in base:
            w.add_tensor(f"{names.get_name(base)}.{suffix}", gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(f"{names.get_name(base)}.{suffix}", data)
    if rope.get("rope_type") == "longrope":
        scale = c.max_position_embeddings / c.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(c.original_max_position_embeddings)))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_gguf_serves_the_checkpoint_it_came_from(kind, phi3_models, tmp_path):
    """Phi-4-mini's form through llama.cpp's layout, greedy against transformers: as float, on the same
    checkpoint; as Q8_0 blocks (kept as blocks: the fused rows split and reordered as blocks), on the
    checkpoint holding the blocks' dequantized values."""
    import gguf
    from safetensors.torch import load_file, save_file

    folder = phi3_models("phi4-mini-long")
    path = tmp_path / "phi3.gguf"
    _write_phi3_gguf(path, folder, kind)
    if kind == "Q8_0":
        oracle = tmp_path / "dequantized"
        shutil.copytree(folder, oracle)
        tensors = load_file(f"{folder}/model.safetensors")
        for name, t in tensors.items():
            if t.dim() == 2 and "embed_tokens" not in name:
                q8 = gguf.quants.quantize(t.numpy(), gguf.GGMLQuantizationType.Q8_0)
                tensors[name] = torch.from_numpy(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0).copy())
        save_file(tensors, oracle / "model.safetensors", metadata={"format": "pt"})
        folder = str(oracle)
    # float32 and float activations into the block matmuls, as the oracle's (a quantized file's dtype "auto"
    # is bfloat16, and int16 activations round them at decode steps).
    llm = LLM(str(path), tokenizer=folder, device="cpu", num_kv_blocks=48, block_size=16, max_model_len=128,
              dtype="float32", cpu_gguf_activations="float")
    assert llm.engine.runner.hf_config.model_type == "phi3"
    layers = llm.engine.runner.model.layers()
    assert {getattr(m.quant_format, "name", "float") for layer in layers
            for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)} == {"float" if kind == "F32" else kind}
    rng = random.Random(2)
    prompts = [[rng.randrange(3, llm.engine.vocab_size) for _ in range(n)] for n in (33, 57, 100)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(folder, p, 6) for p in prompts]


@pytest.mark.slow  # two rank processes
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)], ids=["tp2", "pp2"])
def test_parallel_ranks_load_their_parts_of_the_fused_tensors(layout, phi3_models):
    """TP 2 (gloo on the CPU): each rank takes its query and KV heads out of the split qkv_proj (each head's
    rows reordered first) and its share of gate and up out of gate_up_proj. PP 2: each stage splits only
    its own layers' tensors (the tied embedding on both ends). Greedy tokens are transformers'."""
    path = phi3_models("phi4-mini-long")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 90)]
    with LLM(path, device="cpu", num_kv_blocks=32, block_size=16, max_model_len=128, num_threads=1, seed=0,
             **layout) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 6) for p in prompts]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_at_load_serves_the_dequantized_checkpoint(method, phi3_models, tmp_path):
    """--quantization quantizes each fused matrix whole, then its blocks split and reorder like its rows:
    greedy tokens are transformers' on the checkpoint holding the blocks' dequantized values."""
    from safetensors.torch import load_file, save_file

    from engine.quant.quantize import quantize

    folder = phi3_models("phi4-mini-long")
    oracle = tmp_path / "dequantized"
    shutil.copytree(folder, oracle)
    tensors = load_file(f"{folder}/model.safetensors")
    group = {"quantization_group_size": 32} if method == "int4" else {}
    for name, t in tensors.items():
        if t.dim() == 2 and "embed_tokens" not in name:  # the tied embedding and head stay float
            tensors[name] = quantize(t, method, 32).dequantize().float()
    save_file(tensors, oracle / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(folder, device="cpu", num_kv_blocks=32, block_size=16, max_model_len=128, quantization=method, **group)
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 90)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(str(oracle), p, 6) for p in prompts]


def test_a_bf16_checkpoint_keeps_its_fused_matrices_as_bf16_blocks(phi3_models, tmp_path):
    """On the cpu backend a bfloat16 checkpoint's matrices stay bfloat16 (cpu_bf16_weights): the fused ones
    are split and reordered as blocks too; greedy tokens are transformers' on the same checkpoint in float32."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bf16"
    shutil.copytree(phi3_models("phi4-mini-long"), folder)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(folder / "model.safetensors").items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    llm = LLM(str(folder), device="cpu", dtype="float32", num_kv_blocks=32, block_size=16, max_model_len=128)
    assert {layer.self_attn.qkv_proj.quant_format.name for layer in llm.engine.runner.model.layers()} == {"BF16"}
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (40, 90)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(str(folder), p, 6) for p in prompts]
