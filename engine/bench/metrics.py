"""Metric arithmetic, with the definitions of vLLM's `vllm bench serve` (benchmark_serving).

Per request (streamed):
  TTFT  time from sending the request to the first streamed chunk that carries a choice.
  ITL   the gaps between consecutive such chunks (one entry per gap, pooled over requests).
  E2EL  time from sending the request to its last chunk that carries a choice.
  TPOT  (E2EL - TTFT) / (output_tokens - 1); only for requests with more than one token.
Per run (duration = wall time from the first request sent to the last one finished):
  request throughput = completed / duration
  output throughput  = sum(output tokens) / duration
  total throughput   = (sum(prompt tokens) + sum(output tokens)) / duration
  goodput            = completed requests meeting every SLO / duration
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    """What one streamed request measured (seconds). Filled by the HTTP client."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0  # E2EL
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""
    start_time: float = 0.0  # perf_counter when sent, relative to the run's start


def distribution(values_s: list[float], percentiles: list[float]) -> dict:
    """mean / median / std / pXX of a list of seconds, reported in milliseconds (0 if empty)."""
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    if a.size == 0:
        a = np.zeros(1)
    out = {"mean_ms": float(a.mean()), "median_ms": float(np.median(a)), "std_ms": float(a.std())}
    for p in percentiles:
        out[f"p{p:g}_ms"] = float(np.percentile(a, p))
    return out


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {SLO_METRICS}, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be positive")
    return slos


def serve_metrics(
    results: list[RequestResult], duration_s: float, percentiles: list[float],
    goodput_slos: dict[str, float] | None = None,
) -> dict:
    """vLLM's calculate_metrics over the streamed results of one run."""
    ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], []
    completed = good = total_input = total_output = 0
    for r in results:
        if not r.success:
            continue
        completed += 1
        total_input += r.prompt_len
        total_output += r.output_tokens
        tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        if r.output_tokens > 1:
            tpots.append(tpot)
        all_tpots.append(tpot)
        ttfts.append(r.ttft)
        itls.extend(r.itl)
        e2els.append(r.latency)
        if goodput_slos:
            measured = {"ttft": r.ttft, "tpot": tpot, "e2el": r.latency}
            if all(measured[k] * 1000.0 <= v for k, v in goodput_slos.items()):
                good += 1
    out = {
        "completed": completed,
        "failed": len(results) - completed,
        "duration_s": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s if duration_s > 0 else 0.0,
        "output_throughput": total_output / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration_s if duration_s > 0 else 0.0,
        "ttft": distribution(ttfts, percentiles),
        "tpot": distribution(tpots, percentiles),
        "itl": distribution(itls, percentiles),
        "e2el": distribution(e2els, percentiles),
    }
    if goodput_slos:
        out["goodput_slos_ms"] = dict(goodput_slos)
        out["good_requests"] = good
        out["request_goodput"] = good / duration_s if duration_s > 0 else 0.0
    return out


def throughput_metrics(prompt_lens: list[int], output_lens: list[int], wall_s: float) -> dict:
    """Offline throughput over one generate() call."""
    n_in, n_out = sum(prompt_lens), sum(output_lens)
    return {
        "num_requests": len(prompt_lens),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "wall_s": wall_s,
        "requests_per_s": len(prompt_lens) / wall_s,
        "output_tokens_per_s": n_out / wall_s,
        "total_tokens_per_s": (n_in + n_out) / wall_s,
    }
