"""A serving plan from latency targets: replicas x TP, max_num_seqs and the KV budget that meet a TTFT and a
TPOT target at an arrival rate, with the predicted throughput, TTFT and TPOT.

The step model (a roofline per engine step, as the decode literature states it: Pope et al. 2022,
"Efficiently Scaling Transformer Inference", §2; vLLM's continuous batching):
  decode step    max(bytes moved / memory bandwidth, FLOPs / (peak x efficiency)) + TP all-reduces, where a
                 step moves every weight once and the KV cache of every running sequence (serving.py's
                 kv_bytes_per_token), and computes flops.py's forward FLOPs per sequence
  prefill        the same FLOPs per prompt token (attention over the causal half, the LM head for the last
                 token only) over (peak x efficiency), at least one read of the weights
  TPOT           a decode step of the running batch, stretched by the prefills that share the engine
                 (continuous batching runs them in the same steps): step / (1 - arrival rate x prefill time)
  concurrency    Little's law: running sequences = arrival rate x (TTFT + (output - 1) x TPOT), solved by
                 fixed-point iteration; it must fit the KV cache (capacity / (prompt + output) tokens)
  TTFT           the prompt's prefill, plus half a decode step it waits for on average
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.planning.comm import all_reduce_bytes
from engine.planning.flops import forward_flops_per_token
from engine.planning.serving import kv_bytes_per_token, plan_serving
from engine.planning.spec import ModelSpec

ITERATIONS = 200  # the fixed point converges in a few dozen when a layout can carry the load


@dataclass(frozen=True)
class Device:
    """What one accelerator (or this CPU) does per second, for the step model."""

    name: str
    memory_bytes: int | None  # None on a CPU: the KV budget is given (--kv-cache-memory)
    flops: float  # dense peak at the serving dtype
    memory_bw: float  # bytes/s
    link_bw: float | None = None  # TP all-reduce bandwidth, bytes/s per direction
    efficiency: float = 0.7  # of peak FLOP/s in matmuls (steptime.DEFAULT_COMPUTE_EFFICIENCY's reasoning)


@dataclass(frozen=True)
class Workload:
    prompt_lens: tuple[int, ...]  # an empirical distribution: each value equally likely
    output_lens: tuple[int, ...]

    @property
    def prompt(self) -> float:
        return sum(self.prompt_lens) / len(self.prompt_lens)

    @property
    def output(self) -> float:
        return sum(self.output_lens) / len(self.output_lens)

    @property
    def longest(self) -> int:  # KV a sequence may need: sized for the longest of both
        return max(self.prompt_lens) + max(self.output_lens)


def decode_step_seconds(spec: ModelSpec, device: Device, batch: float, context: float, dtype_bytes: int,
                        kv_dtype_bytes: int, tp: int = 1) -> float:
    weights = spec.params_per_gpu(tp) * dtype_bytes
    kv = batch * context * kv_bytes_per_token(spec, kv_dtype_bytes, tp)
    flops = batch * sum(forward_flops_per_token(spec, context)) / tp  # one query against `context` keys
    step = max((weights + kv) / device.memory_bw, flops / (device.flops * device.efficiency))
    return step + _tp_seconds(spec, device, batch, dtype_bytes, tp)


def prefill_seconds(spec: ModelSpec, device: Device, prompt: float, dtype_bytes: int, tp: int = 1,
                    count: int = 1) -> float:
    """`count` prompts prefilled together: every token through the layers, attending to half the prompt on
    average (causal), and the LM head for the last token of each prompt only (the one that samples)."""
    layers, attention, head = forward_flops_per_token(spec, prompt / 2)
    flops = count * (prompt * (layers + attention) + head) / tp
    weights = spec.params_per_gpu(tp) * dtype_bytes
    compute = max(flops / (device.flops * device.efficiency), weights / device.memory_bw)
    return compute + _tp_seconds(spec, device, count * prompt, dtype_bytes, tp)


def _tp_seconds(spec: ModelSpec, device: Device, tokens: float, dtype_bytes: int, tp: int) -> float:
    """Two all-reduces of tokens x h per layer (Megatron-LM: after attention and after the MLP)."""
    if tp == 1:
        return 0.0
    if device.link_bw is None:
        raise ValueError("tensor parallelism needs a link bandwidth")
    return 2 * spec.num_layers * all_reduce_bytes(tokens * spec.hidden_size * dtype_bytes, tp) / device.link_bw


@dataclass(frozen=True)
class Prediction:
    concurrency: float  # running sequences per replica
    ttft: float
    tpot: float
    throughput: float  # output tokens per second, all replicas
    requests_per_s: float
    stable: bool  # False: the replica cannot keep up (prefills alone fill it, or concurrency diverged)


def predict_open_loop(spec: ModelSpec, device: Device, load: Workload, rate: float, *, tp: int, replicas: int,
                      dtype_bytes: int, kv_dtype_bytes: int) -> Prediction:
    """Steady state of `replicas` engines sharing `rate` requests per second (Poisson arrivals: their mean)."""
    per_replica = rate / replicas
    prefill = prefill_seconds(spec, device, load.prompt, dtype_bytes, tp)
    busy = per_replica * prefill  # share of engine time spent on prefills
    if busy >= 1:
        return Prediction(math.inf, math.inf, math.inf, 0.0, 0.0, False)
    n, tpot = 1.0, 0.0
    for _ in range(ITERATIONS):
        context = load.prompt + load.output / 2
        step = decode_step_seconds(spec, device, n, context, dtype_bytes, kv_dtype_bytes, tp)
        tpot = step / (1 - busy)
        ttft = prefill + step / 2
        new = max(1.0, per_replica * (ttft + (load.output - 1) * tpot))
        if abs(new - n) < 1e-6 * n:
            break
        n = new
        if n > 1e7:
            return Prediction(math.inf, math.inf, math.inf, 0.0, 0.0, False)
    ttft = prefill + decode_step_seconds(spec, device, n, load.prompt, dtype_bytes, kv_dtype_bytes, tp) / 2
    return Prediction(n, ttft, tpot, rate * load.output, rate, True)


def predict_closed_loop(spec: ModelSpec, device: Device, load: Workload, concurrency: int, *, dtype_bytes: int,
                        kv_dtype_bytes: int, tp: int = 1) -> Prediction:
    """`concurrency` clients with requests of equal lengths all queued at once (`engine bench serve
    --max-concurrency c --request-rate inf`): they run in waves of c that start, prefill, decode and finish
    together, so TTFT is the wave's batched prefill and TPOT a decode step of c sequences."""
    prefill = prefill_seconds(spec, device, load.prompt, dtype_bytes, tp, count=concurrency)
    context = load.prompt + load.output / 2
    step = decode_step_seconds(spec, device, concurrency, context, dtype_bytes, kv_dtype_bytes, tp)
    tpot, ttft = step, prefill
    e2el = ttft + (load.output - 1) * tpot
    return Prediction(concurrency, ttft, tpot, concurrency * load.output / e2el, concurrency / e2el, True)


@dataclass(frozen=True)
class SloPlan:
    tp: int
    replicas: int
    gpus: int
    max_num_seqs: int
    kv_budget_bytes: int
    kv_capacity_tokens: int
    prediction: Prediction


class SloError(ValueError):
    """No layout meets a target: `setting` names it, the message says by how much the best one misses."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting, self.message = setting, message


def plan_slo(spec: ModelSpec, device: Device, load: Workload, *, rate: float, ttft: float, tpot: float,
             tp_sizes: list[int], max_gpus: int, dtype_bytes: int, kv_dtype_bytes: int,
             kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
             block_size: int = 16) -> SloPlan:
    """The layout with the fewest GPUs (then the lowest TPOT) that meets both targets."""
    best_miss: tuple[float, str, str] | None = None  # (relative miss, setting, message)
    for gpus in range(1, max_gpus + 1):
        for tp in (t for t in tp_sizes if gpus % t == 0):
            replicas = gpus // tp
            memory = plan_serving(spec, dtype_bytes=dtype_bytes, kv_dtype_bytes=kv_dtype_bytes,
                                  max_model_len=load.longest, block_size=block_size, tp=tp,
                                  gpu_memory_bytes=device.memory_bytes, gpu_memory_utilization=gpu_memory_utilization,
                                  kv_cache_memory_bytes=kv_cache_memory_bytes)
            seqs = memory.kv_capacity_tokens // load.longest
            p = predict_open_loop(spec, device, load, rate, tp=tp, replicas=replicas, dtype_bytes=dtype_bytes,
                                  kv_dtype_bytes=kv_dtype_bytes)
            misses = [(p.ttft / ttft - 1, "ttft_ms", f"TTFT {p.ttft * 1e3:,.1f} ms vs the {ttft * 1e3:,.1f} ms target"),
                      (p.tpot / tpot - 1, "tpot_ms", f"TPOT {p.tpot * 1e3:,.1f} ms vs the {tpot * 1e3:,.1f} ms target"),
                      (p.concurrency / max(seqs, 1e-9) - 1, "request_rate",
                       f"{p.concurrency:,.1f} running sequences per replica, but the KV cache holds {seqs} of "
                       f"{load.longest} tokens")]
            worst = max(misses)
            if worst[0] <= 0:
                return SloPlan(tp, replicas, gpus, max(1, min(seqs, math.ceil(2 * p.concurrency))),
                               memory.kv_budget_bytes, memory.kv_capacity_tokens, p)
            if best_miss is None or worst[0] < best_miss[0]:
                best_miss = (worst[0], worst[1], f"with {gpus} GPUs (TP {tp} x {replicas} replicas): {worst[2]}")
    miss, setting, message = best_miss if best_miss else (math.inf, "max_gpus", "no layout")
    over = "never finishes (the load exceeds what it can prefill)" if math.isinf(miss) else f"{miss:.0%} over"
    raise SloError(setting, f"no layout of at most {max_gpus} GPUs meets the targets; the closest, {message}: "
                            f"{over}")
