"""The GPU-repacked 4/8-bit weight matmul (kernels/triton_quant_packed.py) against the oracle of
test_triton_quant.py: gguf.quants.dequantize of the GGUF blocks that were repacked, rounded to x's
dtype, then a float64 matmul. Both kernels (CUDA-core rows, tensor-core tiles), every split-K path
(empty splits included), odd shapes (N = 45: part-filled column tiles; K of 5 or 13 blocks:
part-filled K steps), and random bytes (every code bit, fp16 scales from subnormal up).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.kernel_cases import DEVICE, DTYPES
from tests.kernels.test_triton_quant import check, quantized_weight, random_blocks

FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


@pytest.fixture(scope="module")
def packed(triton_ops):
    from kernels import triton_quant_packed

    return triton_quant_packed


def test_pack_is_lossless(packed, monkeypatch):
    """Repacking keeps every code and scale: unpacked again in torch, the weights are dequantize's
    (rows repacked 4 at a time: the chunks, the last one short, land in place), in the blocks' bytes."""
    from engine.quant import FORMATS as BLOCK_FORMATS

    monkeypatch.setattr(packed, "PACK_ROWS", 4)

    for fmt in FORMATS:
        blocks, w = random_blocks(fmt, 6, 64, seed=4)
        p = packed.pack(blocks, fmt)
        bits, offset = packed.FORMATS[fmt]
        per_word = 32 // bits
        shifts = torch.arange(per_word) * bits
        codes = ((p.words.t()[..., None].to(torch.int64) & 0xFFFFFFFF) >> shifts) & ((1 << bits) - 1)
        codes = codes.reshape(6, -1, 32).float()
        scales = p.scales.float().permute(0, 2, 1)[..., None]  # [d (, m), N, K / 32, 1]
        d = scales[0]
        m = scales[1] if offset is None else -offset * d
        got = (d * codes + m).reshape(6, -1)
        torch.testing.assert_close(got, torch.from_numpy(w), rtol=0, atol=0)
        torch.testing.assert_close(got, BLOCK_FORMATS[fmt].dequantize(blocks), rtol=0, atol=0)
        assert p.nbytes == blocks.numel(), "as many bytes as the blocks: freeing them keeps the resident size"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_packed_linear_matches_dequantized_matmul(packed, fmt, m, dtype):
    """1 row: the CUDA-core kernel; 3 and 17: tensor-core tiles (16 and 32 rows)."""
    blocks, w = quantized_weight(fmt, 45, 5 * 32, seed=m)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 5 * 32, generator=gen).to(dtype)
    bias = torch.randn(45, generator=gen).to(dtype)
    p = packed.pack(blocks.to(DEVICE), fmt)
    assert packed.launch_plan(m, 45, 160, fmt, 1).kernel == ("gemv" if m <= packed.GEMV_MAX_ROWS else "dot")
    check(packed.packed_linear(x.to(DEVICE), p, bias.to(DEVICE)), x, w, bias)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 70])
def test_every_bit_of_every_packed_field(packed, fmt, m):
    blocks, w = random_blocks(fmt, 70, 7 * 32, seed=m)
    x = torch.randn(m, 7 * 32, generator=torch.Generator().manual_seed(2))
    check(packed.packed_linear(x.to(DEVICE), packed.pack(blocks.to(DEVICE), fmt)), x, w, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [2, 3, 8])
@pytest.mark.parametrize("m", [1, 17])
def test_split_k(packed, m, num_splits, dtype):
    """13 blocks of K: 4 steps of either kernel; 8 splits leave splits empty (they write zeros)."""
    fmt = "Q4_1" if m == 1 else "Q8_0"
    blocks, w = quantized_weight(fmt, 45, 13 * 32, seed=num_splits)
    gen = torch.Generator().manual_seed(num_splits)
    x = torch.randn(m, 13 * 32, generator=gen).to(dtype)
    bias = torch.randn(45, generator=gen).to(dtype)
    got = packed.packed_linear(x.to(DEVICE), packed.pack(blocks.to(DEVICE), fmt), bias.to(DEVICE),
                               num_splits=num_splits)
    check(got, x, w, bias)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_gemv_on_part_filled_tiles_over_many_steps(packed, fmt):
    """The one-row kernel's masked loop, each step's loads issued a step ahead: 29 blocks of K are 8
    steps of 128 weights, the last part-filled, 45 columns part-fill a tile; unsplit (every step in
    one loop) and split 3 ways (3, 3 and 2 steps)."""
    blocks, w = quantized_weight(fmt, 45, 29 * 32, seed=5)
    x = torch.randn(1, 29 * 32, generator=torch.Generator().manual_seed(5))
    p = packed.pack(blocks.to(DEVICE), fmt)
    words = 128 // (32 // packed.FORMATS[fmt][0])
    for num_splits in (1, 3):
        check(packed.packed_linear(x.to(DEVICE), p, num_splits=num_splits, config=("gemv", 1, 64, words, 4, 2)),
              x, w, None)


def test_gemv_whole_tiles_and_splits_summed_by_the_last_to_arrive(packed):
    """Columns filling whole tiles and splits of whole steps (the kernel's EVEN path: no masks), K
    split 1, 2 and 4 ways: the last split of each column tile sums the partials, in split order,
    so each launch gives the same bits, and leaves the arrival counts at 0 for the next launch."""
    blocks, w = quantized_weight("Q4_1", 96, 16 * 32, seed=7)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 16 * 32, generator=gen)
    bias = torch.randn(96, generator=gen)
    p = packed.pack(blocks.to(DEVICE), "Q4_1")
    config = ("gemv", 1, 32, 8, 4, 2)  # 64 weights a step: 8 steps, 3 column tiles
    for num_splits in (1, 2, 4):
        plan = packed.launch_plan(1, 96, 16 * 32, "Q4_1", 1, num_splits=num_splits, config=config)
        assert plan.k_per_split * num_splits == 16 * 32 and plan.k_per_split % 64 == 0
        first = packed.packed_linear(x.to(DEVICE), p, bias.to(DEVICE), num_splits=num_splits, config=config)
        check(first, x, w, bias)
        again = packed.packed_linear(x.to(DEVICE), p, bias.to(DEVICE), num_splits=num_splits, config=config)
        assert torch.equal(first, again)
        assert not packed.split_counts(first.device, 3).any()


def test_leading_dims_strided_rows_and_empty_batches(packed):
    blocks, w = quantized_weight("Q4_1", 33, 96)
    p = packed.pack(blocks.to(DEVICE), "Q4_1")
    x = torch.randn(2, 1, 128, generator=torch.Generator().manual_seed(0))[..., :96]
    check(packed.packed_linear(x.to(DEVICE), p), x, w, None)
    assert packed.packed_linear(torch.empty(0, 96, device=DEVICE), p).shape == (0, 33)


def test_split_heuristic(packed):
    """A decode GEMV of a 1B model's 2048 x 2048 on 132 SMs: 64 column tiles of 32, K split 4 ways
    (one 512-weight step each) to reach 2 programs an SM; the interpreter's one SM never splits;
    a prefill fills the GPU without splitting."""
    plan = packed.launch_plan(1, 2048, 2048, "Q4_1", 132)
    assert (plan.kernel, plan.block_n, plan.num_splits, plan.k_per_split) == ("gemv", 32, 4, 512)
    assert packed.launch_plan(1, 2048, 2048, "Q8_0", 132).k_per_split == 512  # 2 steps of 256: as many words
    assert packed.launch_plan(1, 2048, 2048, "Q4_1", 1).num_splits == 1
    assert packed.launch_plan(1024, 2048, 2048, "Q4_1", 132).num_splits == 1


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_holds_the_repacked_copies_in_the_blocks_bytes(packed, tmp_path, method):
    """On the triton backend every quantized matmul holds a PackedWeight and its blocks are freed,
    and the weights' resident bytes equal the torch backend's (which multiplies the blocks), as does
    the start-up log's summary (every matrix counted, in the same MiB)."""
    from engine import LLM
    from engine.layers.linear import resident_bytes, weight_bytes_summary
    from tests.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2)
    resident = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(path), quantization=method, dtype="float32", device=DEVICE, attention_backend=backend,
                  num_kv_blocks=8, max_model_len=64)
        try:
            model = llm.engine.runner.model
            matmuls = [m for m in model.modules() if getattr(m, "quant_format", None) is not None
                       and hasattr(m, "packed_weight")]
            assert matmuls
            for m in matmuls:
                if backend == "triton":
                    assert isinstance(m.packed_weight, packed.PackedWeight) and m.weight.numel() == 0
                else:
                    assert m.packed_weight is None and m.weight.numel() > 0
            resident[backend] = resident_bytes(model), weight_bytes_summary(model)
        finally:
            llm.shutdown()
    assert resident["triton"] == resident["torch"]


def test_rows_of_the_repacked_copy_are_the_blocks_rows(packed):
    """rows(): a tied embedding's lookup from the repacked copy alone, exactly the blocks' values."""
    from engine.quant import FORMATS as BLOCK_FORMATS

    ids = torch.tensor([0, 69, 5, 5, 33])
    for fmt in FORMATS:
        blocks, _ = random_blocks(fmt, 70, 7 * 32, seed=3)
        got = packed.rows(packed.pack(blocks.to(DEVICE), fmt), ids.to(DEVICE)).cpu()
        torch.testing.assert_close(got, BLOCK_FORMATS[fmt].dequantize(blocks)[ids], rtol=0, atol=0, equal_nan=True)


def test_a_tied_quantized_vocabulary_is_held_once(packed, tmp_path):
    """--quantize-lm-head on a tied model, triton backend: the head's repacked copy is the only copy
    of the vocabulary (the embedding looks its rows up there, its blocks freed), so the resident
    bytes equal the torch backend's, which keeps the blocks alone; and the tokens are the same."""
    from engine import LLM, SamplingParams
    from engine.layers.linear import resident_bytes
    from tests.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                            num_key_value_heads=2, tie_word_embeddings=True)
    resident, tokens = {}, {}
    for backend in ("torch", "triton"):
        llm = LLM(str(path), quantization="int4", quantize_lm_head=True, dtype="float32", device=DEVICE,
                  attention_backend=backend, num_kv_blocks=8, max_model_len=64)
        try:
            model = llm.engine.runner.model
            embed, head = model.model.embed_tokens, model.lm_head
            assert embed.quant_format.name == head.quant_format.name == "Q8_0"
            if backend == "triton":
                assert isinstance(head.packed_weight, packed.PackedWeight) and embed.packed_rows is head.packed_weight
                assert embed.weight.numel() == 0
            else:
                assert embed.packed_rows is None and embed.weight.numel() > 0
            resident[backend] = resident_bytes(model)
            outs = llm.generate([[5, 9, 27, 3], [100, 2]], SamplingParams(temperature=0.0, max_tokens=6),
                                use_tqdm=False)
            tokens[backend] = [o.outputs[0].token_ids for o in outs]
        finally:
            llm.shutdown()
    assert resident["triton"] == resident["torch"]
    assert tokens["triton"] == tokens["torch"]
