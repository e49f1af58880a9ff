"""Each tensor-parallel rank reads only its slice of each checkpoint tensor (SafetensorsSlice):
counted below the engine, at safetensors' own reads, against the bytes a rank's shard holds by the
model's config; the sliced load still gives transformers' greedy tokens. In-process: a narrowed
slice equals the narrowed full tensor."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.loading.safetensors_slices import SafetensorsSlice
from engine.loading.weights import SafetensorsFolder
from tests.parallel.read_counting import READS_DIR_ENV, count_checkpoint_reads, counting_worker_main

TP = 2
FLOAT32 = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A checkpoint of a 2-D float32 matrix, a 2-D bfloat16 one and a stacked [experts, rows, cols] tensor."""
    path = tmp_path_factory.mktemp("slices")
    g = torch.Generator().manual_seed(0)
    save_file({"w": torch.randn(6, 10, generator=g), "b": torch.randn(7, 4, generator=g).to(torch.bfloat16),
               "experts": torch.randn(3, 4, 8, generator=g)}, str(path / "model.safetensors"))
    return str(path)


def _slices(folder: str) -> dict[str, SafetensorsSlice]:
    return dict(SafetensorsFolder(folder))


@pytest.mark.parametrize("dim, start, length", [(0, 2, 3), (1, 4, 5), (0, 0, 6), (1, 9, 1), (0, 3, 0)])
def test_narrow_equals_narrow_of_the_full_tensor(folder, dim, start, length):
    full = load_file(os.path.join(folder, "model.safetensors"))
    tensors = SafetensorsFolder(folder)
    lazy = dict(tensors)
    assert tensors.bytes_read == 0, "handing out the tensors read nothing yet"
    got = lazy["w"].narrow(dim, start, length)
    want = full["w"].narrow(dim, start, length)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.read(), want)
    assert tensors.bytes_read == want.numel() * FLOAT32  # that region alone


def test_nested_index_cast_and_copy_into_a_parameter(folder):
    full = load_file(os.path.join(folder, "model.safetensors"))
    lazy = _slices(folder)
    # One expert of a stacked tensor, then its columns: what FusedMoE's loader asks for.
    expert = lazy["experts"][2].narrow(1, 2, 4).narrow(0, 1, 2)
    assert torch.equal(expert.read(), full["experts"][2].narrow(1, 2, 4).narrow(0, 1, 2))
    assert torch.equal(lazy["experts"][-1].read(), full["experts"][-1])
    # A torch op reads the values: the loaders' param.copy_(loaded), with the dtype cast.
    param = torch.zeros(3, 4)
    param.copy_(lazy["b"].narrow(0, 4, 3))
    assert torch.equal(param, full["b"][4:7].float())
    assert torch.equal(lazy["b"].to(torch.float32).read(), full["b"].float())
    assert lazy["b"][1:5].shape == (4, 4) and lazy["b"].dtype == torch.bfloat16


def test_bad_regions_are_refused(folder):
    w = _slices(folder)["w"]
    with pytest.raises(IndexError):
        w.narrow(0, 4, 3)
    with pytest.raises(IndexError):
        w[6]
    with pytest.raises(TypeError):
        w[::2]


def expected_rank_bytes(path: str, rank: int) -> int:
    """The checkpoint bytes TP rank `rank` of TP ranks needs, from config.json alone: 1/TP of every
    projection's output rows (q/k/v, gate/up) or input columns (o, down), its vocabulary slice of
    the embedding and the LM head (the last rank's is shorter when the vocabulary does not divide),
    and every norm whole."""
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    assert c["num_key_value_heads"] % TP == 0 and not c["tie_word_embeddings"]
    per_rank = -(-vocab // TP)
    vocab_rows = min(per_rank, vocab - rank * per_rank)
    layer = 2 * hidden + (q + 2 * kv) // TP * hidden + hidden * q // TP + 3 * inter // TP * hidden
    return FLOAT32 * (2 * vocab_rows * hidden + hidden + c["num_hidden_layers"] * layer)


@pytest.mark.slow
def test_each_rank_reads_only_its_slice(tiny_model_dir, tmp_path, monkeypatch):
    import safetensors

    from engine import LLM, SamplingParams
    from tests.engine.hf_oracle import hf_greedy

    monkeypatch.setenv(READS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr("engine.executor.executor.worker_main", counting_worker_main)
    monkeypatch.setattr(safetensors, "safe_open", safetensors.safe_open)  # restored after the test
    rank0: list[int] = []
    count_checkpoint_reads(rank0.append)  # rank 0 is this process
    prompts = [[5, 17, 42, 99, 7, 300], [11, 12, 13]]
    with LLM(tiny_model_dir, tensor_parallel_size=TP, device="cpu", num_threads=1, block_size=8,
             num_kv_blocks=16, max_model_len=64, seed=0) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
    reads = [sum(rank0)] + [sum(int(n) for n in (tmp_path / f"rank{r}.txt").read_text().split())
                            for r in range(1, TP)]
    total = os.path.getsize(os.path.join(tiny_model_dir, "model.safetensors"))
    assert reads == [expected_rank_bytes(tiny_model_dir, r) for r in range(TP)]
    assert all(r < 0.55 * total for r in reads), f"ranks read {reads} of a {total}-byte checkpoint"
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(tiny_model_dir, p, 8) for p in prompts]
