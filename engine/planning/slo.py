"""A serving plan from latency targets: replicas x TP, max_num_seqs and the KV budget that meet a TTFT and a
TPOT target at an arrival rate, with the predicted throughput, TTFT and TPOT.

The step model (step_seconds; a roofline per engine step, as the decode literature states it: Pope et al. 2022,
"Efficiently Scaling Transformer Inference", §2; vLLM's continuous batching). A step runs `tokens` rows (one per
decoding sequence, a chunk of each prompt being prefilled) through the layers, the LM head for the rows that
sample, attention reading each decoding sequence's KV cache (serving.py's kv_bytes_per_token) and prefill
attention over its (query, key) pairs:
  GPU            max(bytes moved / memory bandwidth, FLOPs / (peak x efficiency)) + TP all-reduces: every weight
                 moves once a step, and the KV cache of every decoding sequence
  CPU (measured) the sum of what measure.py timed on the spot at the model's shapes: the dense layers' work at
                the step's rows and the LM head's at the sampled rows (measured curves, interpolated), the decode
                attention's KV read at its measured rate, and the prefill attention's FLOPs at theirs
Closed loop (`--concurrency c`, as `engine bench serve --max-concurrency c` runs equal requests): c requests
arrive together and the engine's scheduler is replayed step by step (simulate_wave): running sequences first,
one token each or the next chunk of their prompt, then waiting prompts admitted while the token budget
(max_num_batched_tokens) lasts. With c x prompt over the budget, prompts are prefilled over several steps and
the first ones decode in steps that also carry the others' prompt chunks. TTFT, TPOT ((end - first token) /
(output - 1), vLLM's definition) and throughput follow from the steps' times.
Speculative decoding (`--num-speculative-tokens k --acceptance-rate a`): a decode step verifies k drafts a
sequence, so it runs 1 + k rows a sequence (each through the LM head, each attending to the context) and
yields (1 - a^(k+1)) / (1 - a) tokens on average (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", eq. 1, drafts accepted independently with probability a); TPOT is the step over that.
Open loop (`--slo`, Poisson arrivals at a rate):
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
from engine.planning.flops import matmul_params
from engine.planning.serving import kv_bytes_per_token, plan_serving
from engine.planning.spec import ModelSpec
from engine.planning.weight_formats import WeightFormat, weight_bytes_per_gpu

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
    overlap: bool = True  # True: roofline, memory and compute overlap (a GPU); False: their times add (measure.py)
    kv_bw: float | None = None  # decode attention's KV read rate, bytes/s (None: memory_bw)
    attention_flops: float | None = None  # prefill attention's FLOP/s (None: flops x efficiency)
    dense_curve: tuple[tuple[int, float], ...] = ()  # (rows, seconds) of all layers' work but attention (measure.py)
    head_curve: tuple[tuple[int, float], ...] = ()  # (rows, seconds) of the LM head


@dataclass(frozen=True)
class Speculation:
    """k draft tokens verified a decode step, each accepted with probability `acceptance`."""

    k: int
    acceptance: float

    @property
    def tokens_per_step(self) -> float:
        """Tokens a verify step yields on average: the accepted drafts and the model's own next token."""
        a = self.acceptance
        return self.k + 1.0 if a >= 1 else (1 - a ** (self.k + 1)) / (1 - a)

    @property
    def rows(self) -> int:
        return 1 + self.k


NO_SPECULATION = Speculation(0, 0.0)  # one row and one token a sequence a step


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


def step_seconds(spec: ModelSpec, device: Device, *, tokens: float, sampled: float, kv_tokens: float,
                 prefill_pairs: float, dtype_bytes: int, kv_dtype_bytes: int, tp: int = 1,
                 weight_format: WeightFormat | None = None) -> float:
    """One engine step: `tokens` rows through the layers, `sampled` through the LM head, decode attention reading
    `kv_tokens` cached tokens, prefill attention over `prefill_pairs` (query, key) pairs. The weights read are
    the linear layers in `weight_format` (None: the dtype), the rest at the dtype (weight_formats.py)."""
    kv = kv_tokens * kv_bytes_per_token(spec, kv_dtype_bytes, tp)
    rate = device.flops * device.efficiency
    prefill_attention = 4 * spec.num_layers * spec.q_size / tp * prefill_pairs  # QK^T and AV, causal pairs
    if device.overlap:
        weights = weight_bytes_per_gpu(spec, dtype_bytes, weight_format, tp)
        matmul = 2 * (matmul_params(spec) * tokens + spec.hidden_size * spec.vocab_size * sampled) / tp
        decode_attention = 4 * spec.num_layers * spec.q_size / tp * kv_tokens
        step = max((weights + kv) / device.memory_bw, (matmul + decode_attention + prefill_attention) / rate)
    else:  # measured: the dense layers' and the LM head's time at these rows, plus attention at its own rates
        assert device.dense_curve and device.head_curve, "a device without a roofline needs measure.py's curves"
        step = (interpolate(device.dense_curve, tokens) + (interpolate(device.head_curve, sampled) if sampled else 0)
                + kv / (device.kv_bw or device.memory_bw) + prefill_attention / (device.attention_flops or rate))
    return step + _tp_seconds(spec, device, tokens, dtype_bytes, tp)


def interpolate(curve: tuple[tuple[int, float], ...], rows: float) -> float:
    """Seconds at `rows` on a measured (rows, seconds) curve: linear between the two nearest points, and along
    the last two past its end."""
    (r0, s0), (r1, s1) = next(((a, b) for a, b in zip(curve, curve[1:]) if rows <= b[0]), curve[-2:])
    return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)


def decode_step_seconds(spec: ModelSpec, device: Device, batch: float, context: float, dtype_bytes: int,
                        kv_dtype_bytes: int, tp: int = 1, weight_format: WeightFormat | None = None,
                        speculation: Speculation = NO_SPECULATION) -> float:
    """`batch` sequences, one query each (1 + k with speculation) against `context` cached tokens."""
    rows = batch * speculation.rows
    return step_seconds(spec, device, tokens=rows, sampled=rows, kv_tokens=rows * context, prefill_pairs=0,
                        dtype_bytes=dtype_bytes, kv_dtype_bytes=kv_dtype_bytes, tp=tp, weight_format=weight_format)


def prefill_seconds(spec: ModelSpec, device: Device, prompt: float, dtype_bytes: int, tp: int = 1,
                    count: int = 1, weight_format: WeightFormat | None = None) -> float:
    """`count` prompts prefilled together: every token through the layers, attending causally to the tokens
    before it, and the LM head for the last token of each prompt only (the one that samples)."""
    return step_seconds(spec, device, tokens=count * prompt, sampled=count, kv_tokens=0,
                        prefill_pairs=count * prompt * (prompt + 1) / 2, dtype_bytes=dtype_bytes,
                        kv_dtype_bytes=dtype_bytes, tp=tp, weight_format=weight_format)


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
                      dtype_bytes: int, kv_dtype_bytes: int, weight_format: WeightFormat | None = None,
                      speculation: Speculation = NO_SPECULATION) -> Prediction:
    """Steady state of `replicas` engines sharing `rate` requests per second (Poisson arrivals: their mean)."""
    per_replica = rate / replicas
    prefill = prefill_seconds(spec, device, load.prompt, dtype_bytes, tp, weight_format=weight_format)
    busy = per_replica * prefill  # share of engine time spent on prefills
    if busy >= 1:
        return Prediction(math.inf, math.inf, math.inf, 0.0, 0.0, False)
    n, tpot = 1.0, 0.0
    for _ in range(ITERATIONS):
        context = load.prompt + load.output / 2
        step = decode_step_seconds(spec, device, n, context, dtype_bytes, kv_dtype_bytes, tp, weight_format,
                                   speculation)
        tpot = step / (1 - busy) / speculation.tokens_per_step
        ttft = prefill + step / 2
        new = max(1.0, per_replica * (ttft + (load.output - 1) * tpot))
        if abs(new - n) < 1e-6 * n:
            break
        n = new
        if n > 1e7:
            return Prediction(math.inf, math.inf, math.inf, 0.0, 0.0, False)
    ttft = prefill + decode_step_seconds(spec, device, n, load.prompt, dtype_bytes, kv_dtype_bytes, tp,
                                         weight_format, speculation) / 2
    return Prediction(n, ttft, tpot, rate * load.output, rate, True)


def simulate_wave(spec: ModelSpec, device: Device, prompt: int, output: int, concurrency: int, *, budget: int,
                  dtype_bytes: int, kv_dtype_bytes: int, tp: int = 1, weight_format: WeightFormat | None = None,
                  speculation: Speculation = NO_SPECULATION) -> tuple[list[float], list[float]]:
    """`concurrency` requests arriving together at an idle engine, replayed through the scheduler's rule
    (engine/core/scheduler.py, vLLM's: the running first, a token each or their prompt's next chunk, then waiting
    prompts while the step's token budget lasts). Returns each request's first-token and last-token times. With
    speculation a decoding sequence takes 1 + k rows and gains its expected tokens a step (a fraction)."""
    computed, generated = [0] * concurrency, [0.0] * concurrency
    first, last = [0.0] * concurrency, [0.0] * concurrency
    clock = 0.0
    while min(generated) < output:
        left, rows, kv_tokens, pairs, sampling = budget, 0, 0.0, 0.0, []
        for r in range(concurrency):  # the running are the lower indices: admitted in order
            if left == 0:
                break
            if generated[r] >= output:
                continue
            if computed[r] < prompt:  # its prompt's next chunk
                n = min(prompt - computed[r], left)
                pairs += n * computed[r] + n * (n + 1) / 2  # causal: each query attends to the keys up to it
                computed[r] += n
            else:  # decode: one query (1 + k verifying drafts) against the prompt and the tokens so far
                n = min(speculation.rows, left)
                kv_tokens += n * (prompt + generated[r])
            if computed[r] == prompt:
                sampling.append((r, n))
            rows, left = rows + n, left - n
        clock += step_seconds(spec, device, tokens=rows, sampled=sum(n for _, n in sampling), kv_tokens=kv_tokens,
                              prefill_pairs=pairs, dtype_bytes=dtype_bytes, kv_dtype_bytes=kv_dtype_bytes, tp=tp,
                              weight_format=weight_format)
        for r, n in sampling:
            gain = 1.0 if generated[r] == 0 or n == 1 else speculation.tokens_per_step  # a prompt's first token
            first[r] = clock if generated[r] == 0 else first[r]
            generated[r] = min(float(output), generated[r] + gain)
            last[r] = clock
    return first, last


def predict_closed_loop(spec: ModelSpec, device: Device, load: Workload, concurrency: int, *, dtype_bytes: int,
                        kv_dtype_bytes: int, tp: int = 1, budget: int = 2048,
                        weight_format: WeightFormat | None = None,
                        speculation: Speculation = NO_SPECULATION) -> Prediction:
    """`concurrency` clients with requests of equal lengths all queued at once (`engine bench serve
    --max-concurrency c --request-rate inf`): they run in waves of c that arrive together and, their lengths
    equal, finish together; TTFT and TPOT are the means over a wave's requests (simulate_wave)."""
    first, last = simulate_wave(spec, device, round(load.prompt), round(load.output), concurrency, budget=budget,
                                dtype_bytes=dtype_bytes, kv_dtype_bytes=kv_dtype_bytes, tp=tp,
                                weight_format=weight_format, speculation=speculation)
    ttft = sum(first) / concurrency
    tpot = sum((e - f) / max(1, load.output - 1) for f, e in zip(first, last)) / concurrency
    wave = max(last)
    return Prediction(concurrency, ttft, tpot, concurrency * load.output / wave, concurrency / wave, True)


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
             block_size: int = 16, weight_format: WeightFormat | None = None,
             speculation: Speculation = NO_SPECULATION) -> SloPlan:
    """The layout with the fewest GPUs (then the lowest TPOT) that meets both targets."""
    best_miss: tuple[float, str, str] | None = None  # (relative miss, setting, message)
    for gpus in range(1, max_gpus + 1):
        for tp in (t for t in tp_sizes if gpus % t == 0):
            replicas = gpus // tp
            memory = plan_serving(spec, dtype_bytes=dtype_bytes, kv_dtype_bytes=kv_dtype_bytes,
                                  max_model_len=load.longest, block_size=block_size, tp=tp,
                                  gpu_memory_bytes=device.memory_bytes, gpu_memory_utilization=gpu_memory_utilization,
                                  kv_cache_memory_bytes=kv_cache_memory_bytes, weight_format=weight_format)
            seqs = memory.kv_capacity_tokens // load.longest
            p = predict_open_loop(spec, device, load, rate, tp=tp, replicas=replicas, dtype_bytes=dtype_bytes,
                                  kv_dtype_bytes=kv_dtype_bytes, weight_format=weight_format, speculation=speculation)
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
