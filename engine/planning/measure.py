"""This CPU as a serving device, measured at start through the engine's own CPU kernels at the model's shapes.

The one module of engine/planning that imports torch (and the `kernels` package), lazily, for
`engine plan serve --slo --gpu cpu`. Random weights and caches of the model's shapes, never its checkpoint; the
kernels are those the engine picks on a CPU (kernels.resolve_backend), the weights packed as it packs them.
Three kinds of a step's work, each measured on its own, which the step model (slo.step_seconds) adds up:
  dense layers  every layer's work but attention, in the engine's order, each op taking the previous one's
                output (RMSNorm + residual, q/k/v, rotary, KV write, o, RMSNorm + residual, gate+up, silu x up,
                down), timed at 1, 8, kv_batch, 128, 512 and the token budget's rows (Device.dense_curve; a step
                of other row counts is interpolated linearly between the two nearest). At 1 row a pass streams
                every weight; at the budget it is compute-bound: the curve holds both regimes and the passage
                between them, where a roofline's two rates would guess it. The LM head and the greedy
                pick of each row's token at 1 and kv_batch rows.
  decode KV     kernels.paged_attention, one query per sequence against `kv_batch` sequences of `kv_context`
                cached tokens in every layer's cache: kv_bw = KV bytes / time (the attention's own read rate)
  prefill attn  the same kernel over prompts of the workload's length, causal: (query, key) pairs x 4 x q_size
                FLOPs (QK^T and AV, 2 FLOPs a multiply-add) / time
Not measured, so not in a prediction: the step's work outside the forward (scheduling, sampling, detokenizing,
`python -m engine.bench.step_overhead` measures it) and the CPU time the API server and a benchmark client take
from the same cores to stream each token.
"""

from __future__ import annotations

import math
import statistics
import time

from engine.planning.flops import matmul_params
from engine.planning.slo import Device
from engine.planning.spec import ModelSpec

BLOCK = 16  # the engine's default block_size: the cache layout the attention kernel walks


def _seconds(run, repeats: int) -> float:
    """Median of `repeats` runs after one warm-up (first-touch page faults, oneDNN's kernel selection)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _dense_curves(backend, torch, kind, spec: ModelSpec, up: int, anchors: tuple[int, ...], heads_at: tuple[int, ...],
                  repeats: int) -> tuple[tuple[tuple[int, float], ...], tuple[tuple[int, float], ...]]:
    """Seconds of every layer's work but attention at each row count of `anchors`, as one layer hands its
    output to the next: RMSNorm with the residual add, q/k/v projection, rotary on q and k, the KV write, the
    o projection (of q, standing in for attention's output), RMSNorm, gate+up, silu x up, down. The weights
    (random, packed as the engine packs them) are every layer's own, so a pass streams them all. Then the LM
    head and the greedy pick at each row count of `heads_at`, timed after a pass over the layers. Freed on return."""
    h, q, kv, d, f = spec.hidden_size, spec.q_size, spec.kv_size, spec.head_dim, spec.ffn_hidden_size
    cpu = torch.device("cpu")

    def weight(out: int, inp: int):
        w = (torch.randn(out, inp) * inp ** -0.5).to(kind)
        return w, backend.pack_linear_weight(w)

    layers = [[weight(q + 2 * kv, h), weight(h, q), weight(up, h), weight(h, f)] for _ in range(spec.num_layers)]
    norm = torch.ones(h).to(kind)

    def dense(rows: int):
        x, residual = torch.randn(rows, h).to(kind), torch.randn(rows, h).to(kind)
        cos, sin = torch.randn(rows, 1, d // 2).to(kind), torch.randn(rows, 1, d // 2).to(kind)
        k_cache, v_cache = backend.allocate_kv_cache(-(-rows // BLOCK), BLOCK, spec.num_kv_heads, d, kind, cpu)
        slots = torch.arange(rows)

        def run():
            y, res = x, residual
            for (wqkv, pqkv), (wo, po), (wup, pup), (wdown, pdown) in layers:
                y, res = backend.rms_norm(y, norm, 1e-5, res)
                qkv = backend.linear(y, wqkv, None, pqkv)
                qk = backend.apply_rotary(qkv[:, : q + kv].reshape(rows, -1, d), cos, sin)
                v = qkv[:, q + kv:].reshape(rows, -1, d)
                backend.write_kv(qk[:, q // d:], v, k_cache, v_cache, slots)
                y = backend.linear(qk[:, : q // d].reshape(rows, q), wo, None, po)
                y, res = backend.rms_norm(y, norm, 1e-5, res)
                y = backend.linear(backend.silu_and_mul(backend.linear(y, wup, None, pup)), wdown, None, pdown)
        return run

    curve = tuple((rows, _seconds(dense(rows), repeats)) for rows in anchors)
    head_w, head_p = weight(spec.vocab_size, h)
    after = dense(1)  # the head right after a pass over the layers, as in a step: its weights no longer cached

    def head_seconds(rows: int) -> float:
        x = torch.randn(rows, h).to(kind)
        def run():  # then the greedy pick: float32 logits, max over the vocabulary (engine/runner/sampler.py)
            after()
            backend.linear(x, head_w, None, head_p).to(torch.float32).max(dim=-1)
        return max(0.0, _seconds(run, repeats) - curve[0][1])

    head = tuple((rows, head_seconds(rows)) for rows in heads_at)
    layers.clear()  # free the weights before the next measurement
    return curve, head


def _attention_seconds(backend, torch, kind, spec: ModelSpec, seqs: int, context: int, queries: int,
                       repeats: int) -> float:
    """Every layer's cache of `seqs` sequences of `context` tokens; the last `queries` of each attend."""
    d, kv_heads = spec.head_dim, spec.num_kv_heads
    per_seq = -(-context // BLOCK)
    caches = [backend.allocate_kv_cache(seqs * per_seq, BLOCK, kv_heads, d, kind, torch.device("cpu"))
              for _ in range(spec.num_layers)]
    for k, v in caches:
        k.normal_(), v.normal_()
    tables = torch.arange(seqs * per_seq, dtype=torch.int32).view(seqs, per_seq)
    starts = torch.arange(0, seqs * queries + 1, queries, dtype=torch.int32)
    lens = torch.full((seqs,), context, dtype=torch.int32)
    plan = backend.plan_attention(tables, starts, lens, BLOCK)
    query = torch.randn(seqs * queries, spec.num_heads, d).to(kind)
    return _seconds(lambda: [backend.paged_attention(query, k, v, tables, starts, lens, d ** -0.5, plan=plan)
                             for k, v in caches], repeats)


def measure_cpu(spec: ModelSpec, dtype: str = "bfloat16", *, prompt: int = 512, budget: int = 2048,
                kv_batch: int = 32, kv_context: int = 256, repeats: int = 3, threads: int | None = None) -> Device:
    """`prompt`: the workload's prompt length (prefill attention); `budget`: max_num_batched_tokens."""
    import torch

    import kernels

    if threads:
        torch.set_num_threads(threads)
    kind = getattr(torch, dtype)
    backend = kernels.get_backend(kernels.resolve_backend("auto", "cpu"))
    q, kv, layers = spec.q_size, spec.kv_size, spec.num_layers
    up = 2 * spec.ffn_hidden_size if spec.mlp == "swiglu" else spec.ffn_hidden_size
    anchors = tuple(sorted({a for a in (1, 8, kv_batch, 128, 512) if a < budget} | {budget}))
    dense, head = _dense_curves(backend, torch, kind, spec, up, anchors, (1, kv_batch), repeats)
    weight_bytes = spec.params * torch.finfo(kind).bits // 8
    memory_bw = weight_bytes / (dense[0][1] + head[0][1])  # both at one row: the weights' stream
    flops = 2 * matmul_params(spec) * (budget - 1) / max(dense[-1][1] - dense[0][1], 1e-9)  # for the record
    kv_bytes = kv_batch * kv_context * 2 * layers * kv * torch.finfo(kind).bits // 8
    kv_bw = kv_bytes / _attention_seconds(backend, torch, kind, spec, kv_batch, kv_context, 1, repeats)
    prompts = max(1, budget // prompt)
    pairs = prompts * prompt * (prompt + 1) / 2
    attention_flops = 4 * layers * q * pairs / _attention_seconds(backend, torch, kind, spec, prompts, prompt, prompt,
                                                                  repeats)
    assert all(math.isfinite(v) and v > 0 for v in (memory_bw, flops, kv_bw, attention_flops))
    return Device(name=f"this CPU ({torch.get_num_threads()} threads, {dtype}, {backend.name} kernels)",
                  memory_bytes=None, flops=flops, memory_bw=memory_bw, efficiency=1.0, overlap=False, kv_bw=kv_bw,
                  attention_flops=attention_flops, dense_curve=dense, head_curve=head)
