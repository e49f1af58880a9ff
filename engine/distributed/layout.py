"""The shape of one engine replica: tensor_parallel_size x pipeline_parallel_size ranks, which
stage and TP rank each global rank is, which layers each stage owns, and the checks that reject
a layout the model cannot take, before any process starts.

Global rank = stage * tp + tp_rank, so a stage's TP ranks are neighbours (on one node, under
torchrun's node-major rank order) and rank 0, the scheduler, is stage 0's TP rank 0.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.moe_config import MoeConfig

TORCHRUN_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    layer_ranges: tuple[tuple[int, int], ...]  # one contiguous [start, end) per stage
    expert_parallel: bool = False  # MoE: a stage's TP ranks hold whole experts, not slices of each

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    def stage_of(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank_of(self, rank: int) -> int:
        return rank % self.tp

    def rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank

    def tp_group_ranks(self, stage: int) -> list[int]:
        return [self.rank(stage, t) for t in range(self.tp)]

    @property
    def last_stage_leader(self) -> int:
        """The rank that sends the last stage's logits to rank 0 (its TP rank 0)."""
        return self.rank(self.pp - 1, 0)


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in TORCHRUN_ENV)


def balanced_layer_ranges(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """The first `num_layers % pp` stages get one layer more: the split `engine.planning` assumes."""
    base, extra = divmod(num_layers, pp)
    ranges, start = [], 0
    for stage in range(pp):
        end = start + base + (stage < extra)
        ranges.append((start, end))
        start = end
    return ranges


def partition_ranges(counts: tuple[int, ...], num_layers: int) -> list[tuple[int, int]]:
    """Layer counts per stage (EngineConfig.pipeline_layer_partition, checked there for their number
    and sign) as contiguous ranges; they must add up to the model's layers."""
    if sum(counts) != num_layers:
        example = ",".join(str(b - a) for a, b in balanced_layer_ranges(num_layers, len(counts)))
        raise ValueError(f"pipeline_layer_partition {','.join(map(str, counts))} must add up to the model's "
                         f"{num_layers} layers, e.g. {example}")
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [(s, s + c) for s, c in zip(starts, counts)]


def _or_list(values: list[int]) -> str:
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _tp_problem(tp: int, heads: int, kv_heads: int, ffn: int | None) -> str | None:
    if heads % tp:
        return f"does not divide {heads} attention heads"
    if kv_heads >= tp and kv_heads % tp:
        return f"does not divide {kv_heads} KV heads"
    if kv_heads < tp and tp % kv_heads:
        return f"is not a multiple of the {kv_heads} KV heads (each KV head is replicated on a whole number of ranks)"
    if ffn is not None and ffn % tp:
        return f"does not divide intermediate_size {ffn}"
    return None


def check_layout(config, hf_config) -> ParallelLayout:
    """The layout of one replica of `config` for this model, or a ValueError that says what would work."""
    tp, pp, dp = config.tensor_parallel_size, config.pipeline_parallel_size, config.data_parallel_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    layers = hf_config.num_hidden_layers
    moe = MoeConfig.from_hf_config(hf_config)
    # A dense MLP's intermediate size splits over the ranks; Mixtral's names its experts' instead.
    has_dense = moe is None or any(not moe.is_sparse(i) for i in range(layers))
    ffn = hf_config.intermediate_size if has_dense else None
    problem = _tp_problem(tp, heads, kv_heads, ffn)
    if problem:
        good = [t for t in range(1, heads + 1) if _tp_problem(t, heads, kv_heads, ffn) is None]
        raise ValueError(f"tensor_parallel_size {tp} {problem}; use {_or_list(good)}")
    if config.enable_expert_parallel and moe is None:
        raise ValueError(f"enable_expert_parallel is for mixture-of-experts models; {hf_config.model_type!r} "
                         "has no experts: leave it off")
    if moe is not None and (problem := moe.shard_problem(tp, config.enable_expert_parallel)):
        raise ValueError(problem)
    if pp > layers:
        raise ValueError(f"pipeline_parallel_size {pp} is more than the model's {layers} layers "
                         f"(every stage needs one); use at most {layers}")
    partition = config.layer_partition
    ranges = partition_ranges(partition, layers) if partition else balanced_layer_ranges(layers, pp)
    if launched_by_torchrun():
        if dp > 1:
            raise ValueError("data_parallel_size > 1 starts its replicas itself on one node; under torchrun "
                             "run one server per replica (data_parallel_size 1) behind a load balancer")
        world = int(os.environ["WORLD_SIZE"])
        if world != tp * pp:
            raise ValueError(f"WORLD_SIZE is {world} but tensor_parallel_size {tp} x pipeline_parallel_size {pp} "
                             f"needs {tp * pp} processes; launch {tp * pp} in all (torchrun --nnodes N "
                             f"--nproc-per-node {tp * pp}/N) or change the sizes")
    elif config.device == "cuda" or (config.device == "auto" and _cuda_count() > 0):
        have = _cuda_count()
        if tp * pp * dp > have:
            raise ValueError(f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} x data_parallel_size {dp} "
                             f"needs {tp * pp * dp} GPUs and this machine has {have}; use smaller sizes, "
                             "or device='cpu'")
    return ParallelLayout(tp, pp, tuple(ranges), expert_parallel=config.enable_expert_parallel and tp > 1)


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()
