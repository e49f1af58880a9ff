"""Plan search: every TP / PP / DP / EP / ZeRO / recomputation / micro-batch layout of a cluster that
fits in GPU memory, ranked by training time.

With hardware figures (--gpu, or --peak-tflops and link bandwidths) the time is predicted per layout:
compute + the communication it does not hide + the pipeline bubble (steptime.py), so a layout that
all-reduces over the network ranks behind one that keeps its traffic on NVLink. An end-to-end rate
(--achieved-tflops, --mfu) is the same for every layout; then ties go to the layout that communicates
less and computes in larger pieces: less recomputation, smaller TP, smaller PP, a lower ZeRO stage (stage 3
moves 1.5x: Rajbhandari et al. 2020, §7), a larger micro-batch, then less memory. TP stays within a node
(Narayanan et al. 2021, §3.3). Offloading is not proposed: its PCIe traffic is not in the time estimate.
Pipeline parallelism with ZeRO-2/3 is not proposed: DeepSpeed's PipelineEngine asserts ZeRO stage < 2
("ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism", deepspeed/runtime/pipe/engine.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tqdm import tqdm

from engine.planning.activations import RECOMPUTE
from engine.planning.layout import Layout, PlanError, check_model_parallel, check_positive
from engine.planning.spec import ModelSpec
from engine.planning.training import Throughput, TrainPlan, pipeline_bubble, plan_training

PROGRESS_BAR_FROM = 2000  # layouts; fewer finish before a bar would be worth drawing


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


PP_WITH_ZERO_2_3 = "pipeline parallelism with ZeRO-2/3 (DeepSpeed's PipelineEngine refuses it)"


def candidate_layouts(spec: ModelSpec, nodes: int, gpus_per_node: int, global_batch: int,
                      excluded: dict[str, int] | None = None) -> list[Layout]:
    """Every layout of nodes x gpus_per_node GPUs that realizes `global_batch` exactly; `excluded` counts
    the ones left out, by reason."""
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
                        if pp > 1 and zero >= 2:
                            if excluded is not None:
                                excluded[PP_WITH_ZERO_2_3] = excluded.get(PP_WITH_ZERO_2_3, 0) + len(RECOMPUTE)
                            continue
                        for recompute, ep in itertools.product(RECOMPUTE, expert_parallel_sizes(spec, dp)):
                            layouts.append(Layout(
                                nodes=nodes, gpus_per_node=gpus_per_node, tp=tp, pp=pp, micro_batch=micro_batch,
                                grad_accum=global_batch // (dp * micro_batch), sequence_parallel=sp, zero=zero,
                                recompute=recompute, ep=ep,
                            ))
    return layouts


def expert_parallel_sizes(spec: ModelSpec, dp: int) -> list[int]:
    """EP sizes an MoE model can use: divisors of both the DP size and the expert count."""
    return [ep for ep in divisors(dp) if spec.num_experts % ep == 0] if spec.is_moe else [1]


@dataclass(frozen=True)
class SearchResult:
    considered: int
    plans: list[TrainPlan]  # the ones that fit, best first
    excluded: dict[str, int] = field(default_factory=dict)  # layouts not considered, by reason


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
    excluded: dict[str, int] = {}
    layouts = candidate_layouts(spec, nodes, gpus_per_node, global_batch, excluded)
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
    return SearchResult(considered=len(layouts), plans=fitting, excluded=excluded)


def _rank(plan: TrainPlan) -> tuple:
    layout = plan.layout
    # Without a throughput every plan runs at the same unknown rate: FLOPs per GPU stretched by the bubble.
    time = (plan.time_s if plan.time_s is not None
            else plan.flops / layout.gpus * (1 + pipeline_bubble(layout.pp, layout.grad_accum)))
    return (
        time, RECOMPUTE.index(layout.recompute), layout.tp, layout.pp, layout.ep, layout.zero, -layout.micro_batch,
        plan.memory_per_gpu.total,
    )
