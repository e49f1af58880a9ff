"""Plan search: the layouts it enumerates are valid, the ones it returns fit, ranked by time."""

from engine.planning.search import candidate_layouts, search_plans
from engine.planning.spec import ModelSpec
from engine.planning.training import Throughput
from engine.planning.units import GiB

LLAMA_13B = ModelSpec.from_preset("llama-2-13b")


def test_candidates_realize_the_global_batch_on_every_gpu():
    layouts = candidate_layouts(LLAMA_13B, nodes=2, gpus_per_node=8, global_batch=256)
    assert layouts
    for lay in layouts:
        assert lay.tp * lay.pp * lay.dp == 16 and 8 % lay.tp == 0  # TP within a node
        assert lay.global_batch == 256
        assert lay.zero == 0 or lay.dp > 1
        assert not lay.sequence_parallel or lay.tp > 1


def test_search_returns_fitting_plans_fastest_first():
    result = search_plans(
        LLAMA_13B, nodes=2, gpus_per_node=8, gpu_memory_bytes=40 * GiB, seq_len=4096, global_batch=64,
        tokens=10**10, throughput=Throughput(achieved=300e12), flops_method="exact",
    )
    assert 0 < len(result.plans) < result.considered
    assert all(p.memory_per_gpu.total <= 40 * GiB for p in result.plans)
    times = [p.time_s for p in result.plans]
    assert times == sorted(times)
    best = result.plans[0].layout
    assert best.recompute == "none" or all(p.layout.recompute != "none" for p in result.plans)


def test_pipeline_bubble_makes_fewer_micro_batches_slower():
    result = search_plans(
        LLAMA_13B, nodes=1, gpus_per_node=8, gpu_memory_bytes=80 * GiB, seq_len=2048, global_batch=16,
        tokens=10**9, throughput=Throughput(peak=312e12, intra_node_bw=300e9),  # predicted: the bubble is added
    )
    by_layout = {(p.layout.pp, p.layout.micro_batch, p.layout.tp, p.layout.zero, p.layout.recompute,
                  p.layout.sequence_parallel): p
                 for p in result.plans}
    pp4 = [p for (pp, mb, tp, zero, rc, sp), p in by_layout.items()
           if pp == 4 and tp == 2 and zero == 0 and rc == "none" and not sp]
    assert len(pp4) >= 2
    pp4.sort(key=lambda p: p.layout.micro_batch)
    assert pp4[0].time_s < pp4[-1].time_s  # (p - 1) / m grows as micro-batches get bigger and fewer
