"""Weight formats in the planner: bits per weight as ggml defines them, and `plan serve` weights equal to a real
GGUF file's tensor bytes and to what the engine holds after loading it (or after quantizing at load)."""

from __future__ import annotations

import inspect
import json

import gguf
import numpy as np
import pytest

from engine.planning import ModelSpec
from engine.planning.cli import main
from engine.planning.serving import kv_bytes_per_token
from engine.planning.slo import Device, decode_step_seconds
from engine.planning.weight_formats import ENGINE_FORMATS, FORMATS, GGUF_FORMATS, weight_bytes_per_gpu
from tests.planning.plan_cli import plan as plan_process
from tests.tiny_model import build_tiny_model

# Bits per weight, scales included: ggml-common.h's comments ("Effectively 4.5 bits per weight" for Q4_K, 6.5625
# for Q6_K) and its block sizes; the engine's int8 / int4 are Q8_0 / Q4_1 blocks (engine/quant/quantize.py).
# fp8: the engine's F8_E4M3 blocks (engine/quant/fp8.py: 32 e4m3 bytes and a float32 scale).
PUBLISHED_BITS = {"Q8_0": 8.5, "Q4_0": 4.5, "Q4_1": 5.0, "Q4_K": 4.5, "Q6_K": 6.5625, "int8": 8.5, "int4": 5.0,
                  "fp8": 9.0}
LINEAR = (".q_proj.", ".k_proj.", ".v_proj.", ".o_proj.", ".gate_proj.", ".up_proj.", ".down_proj.")


def serve_json(capsys, *argv):
    assert main(["serve", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", FORMATS)
def test_bits_per_weight(name):
    fmt = FORMATS[name]
    assert fmt.bits_per_weight == PUBLISHED_BITS[name]
    if name in gguf.GGMLQuantizationType.__members__:  # gguf-py's table of ggml's (block size, block bytes)
        assert (fmt.block_size, fmt.block_bytes) == gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]


def test_engine_stores_its_formats_as_the_planner_sizes_them():
    from engine.quant import FORMATS as ENGINE_BLOCKS

    for fmt in GGUF_FORMATS:
        if fmt.name in ENGINE_BLOCKS:
            assert (ENGINE_BLOCKS[fmt.name].block_size, ENGINE_BLOCKS[fmt.name].block_bytes) == \
                (fmt.block_size, fmt.block_bytes)
    for fmt in ENGINE_FORMATS:
        if fmt.stored_as:
            assert ENGINE_BLOCKS[fmt.stored_as].block_bytes == fmt.block_bytes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Hidden 256 and MLP 512: every row is whole K-quant super-blocks of 256 and int4 groups of 128."""
    return build_tiny_model(tmp_path_factory.mktemp("wide"), model_type="llama", hidden_size=256,
                            intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def write_gguf(path, folder: str, qtype: str) -> None:
    """The folder's model as a llama GGUF: linear layers' weights in `qtype` blocks, everything else float32
    (as the engine holds a GGUF's embeddings, LM head and norms: in float, here its CPU dtype)."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(folder)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, c.num_hidden_layers), (w.add_context_length, c.max_position_embeddings),
                       (w.add_embedding_length, c.hidden_size), (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads), (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_rope_freq_base, 10000.0), (w.add_layer_norm_rms_eps, c.rms_norm_eps)):
        add(value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    rng = np.random.default_rng(0)
    kind = gguf.GGMLQuantizationType[qtype]
    block, nbytes = gguf.constants.GGML_QUANT_SIZES[kind]
    for hf_name, data in load_file(f"{folder}/model.safetensors").items():
        base, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if any(part in hf_name for part in LINEAR):
            try:
                blocks = gguf.quants.quantize(np.ascontiguousarray(data), kind)
            except NotImplementedError:  # gguf-py cannot quantize K-quants; sizes are all this test reads
                blocks = rng.integers(0, 256, (data.shape[0], data.shape[1] // block * nbytes), dtype=np.uint8)
            w.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def engine_resident_bytes(path: str, **quantization) -> int:
    """Bytes of every parameter of the engine's model after loading `path` (a GGUF file or a folder)."""
    from tests.engine.engine_runs import loaded_model

    return sum(p.nbytes for p in loaded_model(path, **quantization).parameters())


@pytest.mark.parametrize("qtype", [f.name for f in GGUF_FORMATS])
def test_plan_serve_weights_equal_the_gguf_files_tensor_bytes(capsys, tmp_path, tiny, qtype):
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_gguf(path, tiny, qtype)
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    out = serve_json(capsys, "--model", tiny, "--dtype", "float32", "--weight-format", qtype, "--kv-cache-memory",
                     "64MiB")
    assert out["weights_per_gpu"] == file_bytes
    assert out["weight_format"] == qtype
    from engine.quant import FORMATS as ENGINE_BLOCKS

    if qtype in ENGINE_BLOCKS:  # a format the engine keeps as stored: it holds exactly those bytes
        assert engine_resident_bytes(str(path)) == file_bytes


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("wide-tied"), model_type="llama", hidden_size=256,
                            intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                            tie_word_embeddings=True)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("tied,lm_head", [(False, False), (False, True), (True, True)])
def test_plan_serve_weights_equal_what_the_engine_quantizes_at_load(capsys, request, method, tied, lm_head):
    """--quantize-lm-head: the head's matrix (a tied embedding) in the format too; an untied embedding stays float."""
    from engine.loading.loader import resolve_model

    if "quantization" not in inspect.signature(resolve_model).parameters:
        pytest.skip("this engine has no --quantization yet")
    folder = request.getfixturevalue("tiny_tied" if tied else "tiny")
    head = ["--quantize-lm-head"] * lm_head
    out = serve_json(capsys, "--model", folder, "--dtype", "float32", "--quantization", method, *head,
                     "--kv-cache-memory", "64MiB")
    float32 = serve_json(capsys, "--model", folder, "--dtype", "float32", "--kv-cache-memory", "64MiB")
    assert out["weights_per_gpu"] < float32["weights_per_gpu"]
    assert out["quantize_lm_head"] == lm_head
    assert engine_resident_bytes(folder, quantization=method, quantize_lm_head=lm_head) == out["weights_per_gpu"]
    if lm_head:  # the head alone left the dtype: 4 bytes a weight became its format's (8-bit Q8_0 under int4)
        spec = ModelSpec.from_hf_config(folder)
        vocab = spec.vocab_size * spec.hidden_size
        without = serve_json(capsys, "--model", folder, "--dtype", "float32", "--quantization", method,
                             "--kv-cache-memory", "64MiB")
        head_as = {"int8": "Q8_0", "int4": "Q8_0", "fp8": "fp8"}[method]
        assert without["weights_per_gpu"] - out["weights_per_gpu"] == 4 * vocab - FORMATS[head_as].bytes(vocab)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("method", [None, "int8", "int4"])
def test_plan_on_a_cpu_counts_the_packed_copy_of_a_tied_float_head(capsys, request, method, tied):
    """On the cpu backend a tied float LM head is held twice, the embedding's matrix and oneDNN's
    packed copy (engine/layers/linear.py pack_weights): the plan for `--gpu cpu` equals the engine's
    resident bytes, copies included (it fell short by one vocabulary matrix, 15-37%, for tied models)."""
    from engine import LLM
    from engine.layers.linear import resident_bytes

    folder = request.getfixturevalue("tiny_tied" if tied else "tiny")
    quant = ["--quantization", method] if method else []
    out = serve_json(capsys, "--model", folder, "--dtype", "float32", *quant, "--gpu", "cpu",
                     "--kv-cache-memory", "4MiB")
    with LLM(folder, device="cpu", dtype="float32", quantization=method, kv_cache_memory="4MiB") as llm:
        assert resident_bytes(llm.engine.runner.model) == out["weights_per_gpu"]


def test_quantized_llama_2_7b_weights_and_their_decode_step():
    """int4: 6.48B linear weights at 5 bits, the 262M-weight embedding and LM head and the norms at bf16; the
    roofline's batch-1 decode step reads those bytes (plus the KV cache) from HBM."""
    spec = ModelSpec.from_preset("llama-2-7b")
    linear = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    vocab, norms = 2 * 32000 * 4096, (2 * 32 + 1) * 4096  # embedding + LM head; RMSNorm weights
    assert linear + vocab + norms == spec.params
    assert weight_bytes_per_gpu(spec, 2, FORMATS["int4"]) == linear * 5 // 8 + 2 * (vocab + norms)
    # fp8: a byte a weight and a float32 scale every 32 weights (the engine's F8_E4M3 blocks)
    assert weight_bytes_per_gpu(spec, 2, FORMATS["fp8"]) == linear * 36 // 32 + 2 * (vocab + norms)
    # TP 2: each rank holds half of every linear layer's blocks and half the vocabulary; the norms are replicated
    assert weight_bytes_per_gpu(spec, 2, FORMATS["Q4_0"], tp=2) == linear // 2 * 18 // 32 + 2 * (vocab // 2 + norms)
    h100 = Device("H100", 80 << 30, flops=989.5e12, memory_bw=3.35e12)
    for fmt in (None, FORMATS["int4"]):
        read = weight_bytes_per_gpu(spec, 2, fmt) + 1000 * kv_bytes_per_token(spec, 2)
        assert decode_step_seconds(spec, h100, 1, 1000, 2, 2, weight_format=fmt) == pytest.approx(read / 3.35e12)


def test_router_is_float32_whatever_the_dtype(capsys):
    """The engine's MoE router keeps its weight in float32 (engine/layers/moe.py)."""
    spec = ModelSpec.from_preset("mixtral-8x7b")
    routers = len(spec.moe_layers) * spec.num_experts * spec.hidden_size
    assert weight_bytes_per_gpu(spec, 2) == 2 * (spec.params - routers) + 4 * routers


@pytest.mark.parametrize("argv, flag, says", [
    (["--quantization", "int4", "--weight-format", "Q4_0"], "--weight-format", "not both"),
    (["--quantization", "gptq"], "--quantization", "Q4_0 (4-bit symmetric)"),
    (["--weight-format", "Q5_K"], "--weight-format", "Q4_K"),
    (["--quantization", "int4", "--slo", "--gpu", "cpu", "--request-rate", "1", "--ttft-ms", "100", "--tpot-ms", "100",
      "--kv-cache-memory", "1GiB"], "--quantization", "float weights"),
    (["--quantize-lm-head"], "--quantize-lm-head", "give --quantization int8, int4 or fp8 too"),
    (["--weight-format", "Q4_0", "--quantize-lm-head"], "--quantize-lm-head", "give --quantization"),
])
def test_weight_format_errors_name_the_flag(argv, flag, says):
    done = plan_process("serve", "--model", "llama-2-7b", "--gpu-memory-gib", "80", *argv)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.splitlines()[-1]
    assert flag in last and says in last, done.stderr


def test_slo_plan_with_int4_weights_prints_the_engine_flag(capsys):
    argv = ["--model", "llama-3-70b", "--gpu", "h100-sxm", "--slo", "--request-rate", "2", "--prompt-len", "512",
            "--output-len", "256", "--ttft-ms", "2000", "--tpot-ms", "60"]
    bf16 = serve_json(capsys, *argv)
    int4 = serve_json(capsys, *argv, "--quantization", "int4")
    # 141 GB of bf16 weights need two H100s; at int4 (42.8 GB of linear blocks + 4.2 GB of bf16 embedding and LM
    # head) one holds them with room for the KV cache
    assert (bf16["gpus"], int4["gpus"]) == (2, 1) and int4["kv_budget_bytes"] > 20 << 30
    import engine.config

    if "int4" in getattr(engine.config, "QUANTIZATIONS", ()):
        assert "--quantization int4" in int4["command"]
    head = serve_json(capsys, *argv, "--quantization", "int4", "--quantize-lm-head")
    assert head["kv_budget_bytes"] > int4["kv_budget_bytes"]  # the 2.1 GB bf16 head at 5 bits a weight
    assert "--quantization int4 --quantize-lm-head" in head["command"]
