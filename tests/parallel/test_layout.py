"""Layouts the model cannot take are refused up front, saying what would work; stages split
layers as planning assumes; micro-batches and routing follow their rules. No processes here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.config import EngineConfig
from engine.distributed.layout import balanced_layer_ranges, check_layout
from engine.distributed.pipeline import split_micro_batches
from engine.frontend.router import Router


def hf(heads=4, kv_heads=2, layers=4, ffn=128):
    return SimpleNamespace(model_type="llama", num_attention_heads=heads, num_key_value_heads=kv_heads,
                           num_hidden_layers=layers, intermediate_size=ffn)


def layout(tp=1, pp=1, dp=1, partition=None, **model):
    return check_layout(EngineConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                                     pipeline_layer_partition=partition, device="cpu"), hf(**model))


@pytest.fixture(autouse=True)
def no_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=3), "tensor_parallel_size 3 does not divide 4 attention heads; use 1, 2 or 4"),
    (dict(tp=2, heads=6, kv_heads=3, ffn=96), "tensor_parallel_size 2 does not divide 3 KV heads; use 1, 3 or 6"),
    (dict(tp=4, heads=8, kv_heads=8, ffn=98), "does not divide intermediate_size 98; use 1 or 2"),
    (dict(pp=5), "pipeline_parallel_size 5 is more than the model's 4 layers (every stage needs one); use at most 4"),
])
def test_impossible_layouts_say_what_works(kwargs, message):
    with pytest.raises(ValueError) as e:
        layout(**kwargs)
    assert message in str(e.value)


def test_tp_beyond_kv_heads_replicates_them():
    assert layout(tp=4, kv_heads=2).world_size == 4  # two ranks share each KV head


def test_balanced_split_is_planning_s():
    assert balanced_layer_ranges(7, 3) == [(0, 3), (3, 5), (5, 7)]  # the first L mod pp stages one more
    lay = layout(tp=2, pp=2)
    assert lay.layer_ranges == ((0, 2), (2, 4))
    assert [lay.stage_of(r) for r in range(4)] == [0, 0, 1, 1] and lay.tp_group_ranks(1) == [2, 3]
    assert lay.last_stage_leader == 2


def test_layer_partition_override():
    assert layout(pp=2, partition="3,1").layer_ranges == ((0, 3), (3, 4))
    assert layout(pp=2, partition=(1, 3)).layer_ranges == ((0, 1), (1, 4))
    with pytest.raises(ValueError, match="pipeline_layer_partition 2,1 must add up to the model's 4 layers, e.g. 2,2"):
        layout(pp=2, partition="2,1")


def test_torchrun_world_must_match(monkeypatch):
    for name, value in dict(RANK="0", WORLD_SIZE="3", LOCAL_RANK="0", MASTER_ADDR="h", MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="WORLD_SIZE is 3 but tensor_parallel_size 2 x pipeline_parallel_size 2 "
                                         "needs 4"):
        layout(tp=2, pp=2)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="under torchrun run one server per replica"):
        layout(dp=2)


def test_cli_rejects_before_starting_anything(gqa_model, capsys):
    from engine.cli import main

    assert main(["generate", "hi", "--model", gqa_model, "--tensor-parallel-size", "3"]) == 2
    assert "tensor_parallel_size 3 does not divide 4 attention heads; use 1, 2 or 4" in capsys.readouterr().err


def test_micro_batches_are_contiguous_and_balanced():
    decodes = [(f"r{i}", 1) for i in range(12)]
    assert [len(mb) for mb in split_micro_batches(decodes, 2)] == [6, 6]
    mixed = [("long", 30), ("a", 1), ("b", 1), ("c", 1)]
    assert split_micro_batches(mixed, 2) == [[("long", 30)], [("a", 1), ("b", 1), ("c", 1)]]
    assert split_micro_batches([("only", 32)], 2) == [[("only", 32)]]  # a request is never split
    assert [x for mb in split_micro_batches(decodes, 3) for x in mb] == decodes


def test_router_least_loaded_with_prefix_affinity():
    r = Router(2, block_size=4, slack=2)
    assert [r.choose([i] * 5) for i in range(4)] == [0, 1, 0, 1]  # idle replicas alternate
    shared = [7, 7, 7, 7, 1]
    home = r.choose(shared)
    other = 1 - home
    assert r.load[home] == r.load[other] + 1
    assert r.choose(shared + [2]) == home  # same first block, load within the slack: its home
    assert r.affinity_hits == 1
    r.load[home] += 2
    assert r.choose(shared) == other  # home too busy now: the least loaded wins, and becomes the home
    least = min((0, 1), key=lambda i: (r.load[i], r.routed[i]))
    assert r.choose([5, 5, 5, 5]) == least  # one block only, whose last token is always computed: no affinity
    loads = list(r.load)
    r.finished(home)
    assert r.load[home] == loads[home] - 1 and sum(r.routed) == 8
