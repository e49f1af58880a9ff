"""Communication volume: bytes each GPU sends for the collectives of a parallel layout.

Collectives over N ranks, each holding K bytes (Patarasuk & Yuan 2009 for the ring; the same counts are
NCCL's "bus bandwidth" factors, nccl-tests doc/PERFORMANCE.md):
  ring all-reduce           2 (N - 1) / N x K   (a reduce-scatter, then an all-gather)
  reduce-scatter, all-gather  (N - 1) / N x K
  all-to-all                (N - 1) / N x K     (each rank keeps 1/N of what it holds)
  point-to-point            K
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.planning.layout import Layout
from engine.planning.lora import LoraSpec, adapter_tensors, frozen_base_bytes
from engine.planning.spec import ModelSpec


def all_reduce_bytes(nbytes: float, ranks: int) -> float:
    return 2 * (ranks - 1) / ranks * nbytes


def reduce_scatter_bytes(nbytes: float, ranks: int) -> float:
    return (ranks - 1) / ranks * nbytes


all_gather_bytes = reduce_scatter_bytes  # the same ring, run the other way


def all_to_all_bytes(nbytes: float, ranks: int) -> float:
    """Under uniform routing, (N - 1) / N of what a rank holds leaves it; 1/N stays home."""
    return (ranks - 1) / ranks * nbytes


def moe_all_to_all_bytes(spec: ModelSpec, tokens: int, act_bytes: int, ep: int, *, passes: int = 1,
                         moe_layers: int | None = None) -> float:
    """Bytes one EP rank sends in the expert all-to-alls while `tokens` of its own pass through.

    Each MoE layer dispatches every token's hidden vector (h x act_bytes) to each of its top-k experts
    and combines the k results back: two all-to-alls of tokens x k x h x act_bytes each (GShard,
    Lepikhin et al. 2021, §2.2: dispatch and combine). Of that, (ep - 1) / ep leaves the rank. `passes`
    counts the times it happens per token: 1 for inference, 2 for training (the backward sends the
    gradients along the reverse path), 3 with full recomputation (the forward runs again).
    """
    if not spec.is_moe or ep == 1:
        return 0.0
    layers = len(spec.moe_layers) if moe_layers is None else moe_layers
    per_layer = 2 * all_to_all_bytes(tokens * spec.experts_per_token * spec.hidden_size * act_bytes, ep)
    return passes * layers * per_layer


def point_to_point_bytes(nbytes: float) -> float:
    return float(nbytes)


@dataclass(frozen=True)
class Collective:
    """One kind of communication of a training step, per GPU per optimizer step."""

    name: str
    kind: str  # "dp", "tp", "pp" or "ep": the parallelism it serves
    bytes_sent: float
    ranks: int
    crosses_nodes: bool  # the slowest link it crosses: a node's NIC rather than NVLink / xGMI / PCIe
    formula: str  # how bytes_sent was counted, with its source (for --explain)
    overlapped: bool = False  # DP gradient sync runs behind the backward pass (DDP buckets, ZeRO's IPG)
    every_micro_batch: bool = False  # ZeRO-2/3 traffic recurs with each micro-batch, not once per step


def dp_sync(grad_bytes: float, ranks: int, zero: int, micro_batches: int) -> tuple[float, str]:
    """Bytes per GPU per optimizer step to synchronize `grad_bytes` of gradients over `ranks` DP ranks.

    ZeRO 0-1: one ring all-reduce per step (ZeRO-1 as reduce-scatter + all-gather: the same volume).
    ZeRO-2: the gradients are reduce-scattered at every micro-batch (only a partition is kept), the
    updated parameters all-gathered once per step. ZeRO-3: at every micro-batch the parameters are
    all-gathered for the forward and again for the backward, the gradients reduce-scattered: 3 (N-1)/N
    per micro-batch, 1.5x plain data parallelism at one micro-batch (Rajbhandari et al. 2020, §7.2).
    """
    if zero <= 1:
        return all_reduce_bytes(grad_bytes, ranks), "all-reduce 2(N-1)/N x K once per step"
    if zero == 2:
        return ((micro_batches + 1) * reduce_scatter_bytes(grad_bytes, ranks),
                "reduce-scatter (N-1)/N x K per micro-batch + all-gather (N-1)/N x K per step (ZeRO-2)")
    return (3 * micro_batches * reduce_scatter_bytes(grad_bytes, ranks),
            "2 all-gathers + 1 reduce-scatter, (N-1)/N x K each, per micro-batch (ZeRO-3, paper §7.2: 1.5x DP)")


def training_collectives(spec: ModelSpec, layout: Layout, seq_len: int, act_bytes: int,
                         lora: LoraSpec | None = None) -> list[Collective]:
    """The communication of one optimizer step on the busiest GPU of a layout.

    Ranks are placed as Megatron-LM does (TP innermost, then DP with EP inside it, PP outermost), so a
    TP group stays in a node, a DP or EP group crosses nodes once tp x dp (tp x ep) exceeds a node, and
    pipeline stages sit on different nodes once there is more than one. `act_bytes` is the size of an
    activation, a gradient and a 16-bit weight alike (4 in pure float32 training). With `lora` the DP
    ranks synchronize the adapters' gradients only; under ZeRO-3 they also gather the frozen base, at its
    storage precision, for each micro-batch's forward and backward.
    """
    tp, pp, dp, ep, m, gpn = layout.tp, layout.pp, layout.dp, layout.ep, layout.grad_accum, layout.gpus_per_node
    tokens, h = layout.micro_batch * seq_len, spec.hidden_size
    stage = spec.stage_params(tp, pp, expert_shards=ep * tp)
    layers, moe_layers = -(-spec.num_layers // pp), -(-len(spec.moe_layers) // pp)
    out = []
    groups = (("DP gradient sync", stage.elements - stage.expert_elements, dp),
              ("expert-DP gradient sync", stage.expert_elements, dp // ep))
    if lora is not None:
        adapters = spec.extra_tensors_per_gpu(adapter_tensors(spec, lora), tp, pp).elements
        groups = (("DP gradient sync", adapters, dp),) if layout.zero < 3 else ()
        if layout.zero >= 3 and dp > 1:
            frozen = frozen_base_bytes(spec, lora, act_bytes, tp, pp, ep * tp)
            out.append(Collective(
                "DP gradient sync", "dp", m * (2 * reduce_scatter_bytes(frozen, dp)
                                               + reduce_scatter_bytes(adapters * act_bytes, dp)), dp, tp * dp > gpn,
                f"2 all-gathers of the frozen base ({frozen:,} B) + 1 reduce-scatter of {adapters:,} adapter "
                f"gradients x {act_bytes} B, (N-1)/N each, per micro-batch (ZeRO-3)", overlapped=True,
                every_micro_batch=True))
    for name, params, ranks in groups:
        if params and ranks > 1:
            volume, how = dp_sync(params * act_bytes, ranks, layout.zero, m)
            out.append(Collective(name, "dp", volume, ranks, tp * dp > gpn,
                                  f"K = {params:,} gradients x {act_bytes} B; {how}", overlapped=True,
                                  every_micro_batch=layout.zero >= 2))
    if tp > 1:
        # Megatron-LM (Narayanan et al. 2021, §3.3; Korthikanti et al. 2022, §4.2.2): two all-reduces of
        # the b x s x h layer output in the forward, two in the backward; with SP a reduce-scatter and an
        # all-gather of the same volume replace each. Full recomputation runs the forward's two again.
        per_layer = 6 if layout.recompute == "full" else 4
        out.append(Collective(
            "TP " + ("reduce-scatter + all-gather" if layout.sequence_parallel else "all-reduce"), "tp",
            m * layers * per_layer * all_reduce_bytes(tokens * h * act_bytes, tp), tp, False,
            f"{per_layer} x 2(t-1)/t x b s h x {act_bytes} B per layer per micro-batch (Korthikanti 2022, §4.2.2)"))
    if pp > 1:
        # Each micro-batch's activations go to the next stage and its gradients come back; with TP each
        # rank sends its 1/t slice (Megatron's scatter/gather optimization, Narayanan et al. 2021, §4.1).
        out.append(Collective("PP send/recv", "pp", m * 2 * point_to_point_bytes(tokens * h * act_bytes / tp), 2,
                              layout.nodes > 1, "2 x b s h / t x bytes per micro-batch (Narayanan 2021, §4.1)"))
    if ep > 1 and moe_layers:
        out.append(Collective(
            "EP all-to-all", "ep", moe_all_to_all_bytes(spec, tokens * m, act_bytes, ep, moe_layers=moe_layers,
                                                  passes=3 if layout.recompute == "full" else 2),
            ep, tp * ep > gpn, "dispatch + combine: 2 x (N-1)/N x b s k h x bytes per MoE layer per pass (GShard)"))
    return out
