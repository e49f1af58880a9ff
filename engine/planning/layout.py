"""A parallel training layout, and the rules a layout and a model must satisfy together.

Each violated rule raises PlanError naming the setting to change, so the CLI can name the flag.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.planning.activations import RECOMPUTE
from engine.planning.memory import OFFLOADS, ZERO_STAGES
from engine.planning.spec import ModelSpec


class PlanError(ValueError):
    """A setting the user can change; `setting` is its name (the CLI flag without the dashes)."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting, self.message = setting, message


def check_positive(**values: float | None) -> None:
    for name, value in values.items():
        if value is not None and value <= 0:
            raise PlanError(name, f"must be positive, got {value}")


def check_model_parallel(spec: ModelSpec, tp: int, pp: int) -> None:
    """Megatron-LM's rules: TP splits heads and the MLP evenly; each pipeline stage gets a layer."""
    check_positive(tp=tp, pp=pp)
    if spec.num_heads % tp:
        raise PlanError("tp", f"{tp} does not divide the model's {spec.num_heads} attention heads")
    if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
        raise PlanError("tp", f"{tp} neither divides nor is a multiple of the {spec.num_kv_heads} KV heads")
    dense_ffn = spec.ffn_hidden_size if len(spec.moe_layers) < spec.num_layers else None
    for units, what in ((dense_ffn, "MLP's"), (spec.shared_expert_ffn_size, "shared expert's")):
        if units and units % tp:
            raise PlanError("tp", f"{tp} does not divide the {what} {units} hidden units")
    if pp > spec.num_layers:
        raise PlanError("pp", f"{pp} stages for {spec.num_layers} layers leaves a stage empty")


def check_expert_parallel(spec: ModelSpec, ep: int, expert_tp: int) -> None:
    """EP gives each rank experts / ep whole experts; expert TP splits each expert's hidden units."""
    check_positive(ep=ep)
    if ep > 1 and not spec.is_moe:
        raise PlanError("ep", f"{ep}-way expert parallelism needs experts; {spec.name} is a dense model")
    if spec.is_moe and spec.num_experts % ep:
        raise PlanError("ep", f"{ep} does not divide the model's {spec.num_experts} experts")
    if spec.is_moe and spec.expert_ffn_size % expert_tp:
        raise PlanError("tp", f"{expert_tp} does not divide an expert's {spec.expert_ffn_size} hidden units")


@dataclass(frozen=True)
class Layout:
    nodes: int = 1
    gpus_per_node: int = 1
    tp: int = 1
    pp: int = 1
    micro_batch: int = 1
    grad_accum: int = 1
    sequence_parallel: bool = False
    zero: int = 0
    offload: str = "none"
    recompute: str = "none"
    ep: int = 1  # expert-parallel ranks, carved out of the DP ranks (Megatron-LM's expert_model_parallel_size)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        """Data-parallel replicas: GPUs / (TP x PP)."""
        return self.gpus // (self.tp * self.pp)

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: grad accumulation x data-parallel size x micro batch."""
        return self.grad_accum * self.dp * self.micro_batch

    def check(self, spec: ModelSpec) -> None:
        check_positive(nodes=self.nodes, gpus_per_node=self.gpus_per_node, micro_batch=self.micro_batch,
                       grad_accum=self.grad_accum)
        check_model_parallel(spec, self.tp, self.pp)
        if self.tp > self.gpus_per_node:
            raise PlanError("tp", f"{self.tp} exceeds the {self.gpus_per_node} GPUs of a node by "
                                  f"{self.tp - self.gpus_per_node}: TP all-reduces twice per layer and needs the "
                                  f"intra-node links (Narayanan et al. 2021, §3.3)")
        if self.gpus % (self.tp * self.pp):
            raise PlanError("tp", f"tp x pp = {self.tp * self.pp} does not divide the {self.gpus} GPUs "
                                  f"(nodes x gpus-per-node)")
        check_expert_parallel(spec, self.ep, self.tp)
        if self.dp % self.ep:
            raise PlanError("ep", f"{self.ep} does not divide the {self.dp} data-parallel ranks it is carved from")
        if self.zero not in ZERO_STAGES:
            raise PlanError("zero", f"must be one of {ZERO_STAGES}, got {self.zero}")
        if self.offload not in OFFLOADS:
            raise PlanError("offload", f"must be one of {OFFLOADS}, got {self.offload!r}")
        if self.offload != "none" and self.zero < 2:
            raise PlanError("offload", "ZeRO-Offload partitions gradients and optimizer state first: needs zero >= 2")
        if self.offload == "optimizer+params" and self.zero < 3:
            raise PlanError("offload", "offloading parameters needs their ZeRO-3 partition: zero 3")
        if self.pp > 1 and self.zero >= 2:
            raise PlanError("zero", f"ZeRO-{self.zero} with {self.pp} pipeline stages: DeepSpeed's PipelineEngine "
                                    "refuses ZeRO-2/3 with pipeline parallelism; use --zero 1 or --pp 1")
        if self.recompute not in RECOMPUTE:
            raise PlanError("recompute", f"must be one of {RECOMPUTE}, got {self.recompute!r}")
