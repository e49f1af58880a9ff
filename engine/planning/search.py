"""Plan search: every TP / PP / DP / ZeRO / recomputation / micro-batch layout of a cluster that fits
in GPU memory, ranked by estimated training time.

Estimated time is the training plan's FLOPs-over-rate time, which already charges recomputation
(8ND or the exact count) and the pipeline bubble (p - 1) / m. Communication is not modeled, so ties
go to the layout that communicates less and computes in larger pieces: less recomputation, smaller
TP (all-reduces of activations in every layer), smaller PP, a lower ZeRO stage (stages 1-2 move as
much as plain data parallelism, stage 3 1.5x: Rajbhandari et al. 2020, §7), a larger micro-batch,
then less memory. TP stays within a node (Narayanan et al. 2021, §3.3: it needs the intra-node links). Offloading is not
proposed: its PCIe traffic is not in the time estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from tqdm import tqdm

from engine.planning.activations import RECOMPUTE
from engine.planning.layout import Layout, PlanError, check_model_parallel, check_positive
from engine.planning.spec import ModelSpec
from engine.planning.training import Throughput, TrainPlan, pipeline_bubble, plan_training

PROGRESS_BAR_FROM = 2000  # layouts; fewer finish before a bar would be worth drawing


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(spec: ModelSpec, nodes: int, gpus_per_node: int, global_batch: int) -> list[Layout]:
    """Every layout of nodes x gpus_per_node GPUs that realizes `global_batch` exactly."""
    gpus, layouts = nodes * gpus_per_node, []
    for tp in divisors(gpus_per_node):
        for pp in divisors(gpus // tp):
            try:
                check_model_parallel(spec, tp, pp)
            except PlanError:
                continue
            dp = gpus // (tp * pp)
            if global_batch % dp:
                continue
            for micro_batch in divisors(global_batch // dp):
                for sp in (False, True) if tp > 1 else (False,):
                    for zero in (0, 1, 2, 3) if dp > 1 else (0,):
                        for recompute in RECOMPUTE:
                            layouts.append(Layout(
                                nodes=nodes, gpus_per_node=gpus_per_node, tp=tp, pp=pp, micro_batch=micro_batch,
                                grad_accum=global_batch // (dp * micro_batch), sequence_parallel=sp, zero=zero,
                                recompute=recompute,
                            ))
    return layouts


@dataclass(frozen=True)
class SearchResult:
    considered: int
    plans: list[TrainPlan]  # the ones that fit, best first


def search_plans(
    spec: ModelSpec,
    *,
    nodes: int,
    gpus_per_node: int,
    gpu_memory_bytes: int,
    seq_len: int,
    global_batch: int,
    tokens: int,
    throughput: Throughput = Throughput(),
    **plan_kwargs,
) -> SearchResult:
    """`plan_kwargs` go to plan_training (precision, optimizer, attention, flops_method)."""
    check_positive(nodes=nodes, gpus_per_node=gpus_per_node, gpu_memory=gpu_memory_bytes, global_batch=global_batch)
    layouts = candidate_layouts(spec, nodes, gpus_per_node, global_batch)
    if not layouts:
        raise PlanError("global_batch", f"{global_batch} cannot be split evenly over any data-parallel size of "
                                        f"{nodes * gpus_per_node} GPUs")
    fitting = []
    for layout in tqdm(layouts, desc="layouts", unit="layout",
                       disable=True if len(layouts) < PROGRESS_BAR_FROM else None):
        plan = plan_training(
            spec, layout, seq_len=seq_len, tokens=tokens, throughput=throughput, gpu_memory_bytes=gpu_memory_bytes,
            **plan_kwargs
        )
        if plan.fits:
            fitting.append(plan)
    fitting.sort(key=_rank)
    return SearchResult(considered=len(layouts), plans=fitting)


def _rank(plan: TrainPlan) -> tuple:
    layout = plan.layout
    # Without a throughput every plan runs at the same unknown rate: FLOPs per GPU stretched by the bubble.
    time = (plan.time_s if plan.time_s is not None
            else plan.flops / layout.gpus * (1 + pipeline_bubble(layout.pp, layout.grad_accum)))
    return (
        time, RECOMPUTE.index(layout.recompute), layout.tp, layout.pp, layout.zero, -layout.micro_batch,
        plan.memory_per_gpu.total,
    )
