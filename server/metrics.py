"""Prometheus metrics (`pagewise:` prefix, one CollectorRegistry per app).

Gauges and token counters are read from AsyncEngine.stats() at scrape time; latency
histograms and finish reasons are observed per request by `track()`, which wraps any
engine stream, so data-parallel replicas behind the same interface are measured alike.
"""

from __future__ import annotations

import time
from typing import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.frontend.async_engine import EngineOverloadedError
from engine.outputs import RequestOutput
from engine.request import LoRARequest

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5)

# stats() key -> (metric name, help). Gauges are instantaneous; counters only grow.
GAUGES = {
    "num_running": ("pagewise:num_requests_running", "Requests in the running batch."),
    "num_waiting": ("pagewise:num_requests_waiting",
                    "Requests waiting to be scheduled (incl. not yet handed to the engine)."),
    "kv_cache_usage": ("pagewise:kv_cache_usage_perc", "Fraction of KV-cache blocks referenced (0-1)."),
    "num_used_blocks": ("pagewise:num_used_kv_blocks", "KV-cache blocks referenced by requests."),
    "num_total_blocks": ("pagewise:num_total_kv_blocks", "KV-cache blocks in the pool."),
    "prefix_cache_hit_rate": ("pagewise:prefix_cache_hit_rate", "Prefix-cache hits / queries (0-1), since start."),
    "healthy": ("pagewise:engine_healthy", "1 while the engine loop is alive."),
}
COUNTERS = {
    "prompt_tokens_total": ("pagewise:prompt_tokens", "Prefill tokens processed."),
    "generation_tokens_total": ("pagewise:generation_tokens", "Tokens generated."),
    "prefix_cache_queries": ("pagewise:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("pagewise:prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "num_preemptions": ("pagewise:num_preemptions", "Requests preempted (blocks ran out; recomputed later)."),
    "num_requests_rejected": ("pagewise:requests_rejected", "Requests refused by admission control (HTTP 503)."),
    "num_requests_routed": ("pagewise:requests_routed", "Requests routed to each data-parallel replica."),
    "num_drafts": ("pagewise:spec_decode_num_drafts", "Speculative draft runs verified (a stream's drafts of a step)."),
    "num_draft_tokens": ("pagewise:spec_decode_num_draft_tokens", "Speculative draft tokens verified."),
    "num_accepted_tokens": ("pagewise:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted."),
}


class _EngineCollector:
    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name

    def collect(self):
        stats = self.engine.stats()
        # Data parallel: a metric each replica reports is one sample per replica, labelled `replica`.
        replicas = stats.get("replicas") or []
        for table, kind in ((GAUGES, GaugeMetricFamily), (COUNTERS, CounterMetricFamily)):
            for key, (name, doc) in table.items():
                if replicas and key in replicas[0]:
                    family = kind(name, doc, labels=["model_name", "replica"])
                    for i, replica in enumerate(replicas):
                        family.add_metric([self.model_name, str(i)], float(replica[key]))
                    yield family
                elif key in stats:
                    family = kind(name, doc, labels=["model_name"])
                    family.add_metric([self.model_name], float(stats[key]))
                    yield family


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram("pagewise:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("pagewise:inter_token_latency_seconds", "Time between output tokens.", labels,
                             buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("pagewise:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.finished = Counter("pagewise:requests_finished", "Finished choices by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.lora_requests = Counter("pagewise:lora_requests", "Requests finished per LoRA adapter.",
                                     ["model_name", "lora_name"], registry=self.registry)
        self.lora_tokens = Counter("pagewise:lora_generation_tokens", "Tokens generated per LoRA adapter.",
                                   ["model_name", "lora_name"], registry=self.registry)
        self.registry.register(_EngineCollector(engine, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def track(self, stream: AsyncIterator[RequestOutput], num_choices: int,
                    lora: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Pass outputs through, observing the first token's latency, the gaps between tokens and the
        whole request's from the times the engine stamped on them (so whole outputs count as deltas
        do), and counting how each of its `num_choices` choices ended (stop / length / abort /
        error) — all of them, even when the client leaves before the first output; a request with
        a LoRA adapter counts for it too."""
        num_tokens = 0
        last = 0.0
        unfinished_reason = "abort"  # what to count if no final output arrives: the client left
        try:
            async for output in stream:
                for when, new in output.token_times:
                    if num_tokens == 0:
                        self.ttft.observe(when - output.arrival_time)
                    else:
                        for _ in range(new):  # tokens that came out together share their gap
                            self.itl.observe((when - last) / new)
                    num_tokens, last = num_tokens + new, when
                    if lora is not None:
                        self.lora_tokens.labels(self.model_name, lora.lora_name).inc(new)
                for choice in output.outputs:
                    if choice.finish_reason is not None:
                        self.finished.labels(self.model_name, choice.finish_reason).inc()
                if output.finished:
                    if lora is not None:
                        self.lora_requests.labels(self.model_name, lora.lora_name).inc()
                    unfinished_reason = None
                    if output.arrival_time is not None:
                        self.e2e.observe(time.perf_counter() - output.arrival_time)
                yield output
        except (ValueError, EngineOverloadedError):
            unfinished_reason = None  # refused at admission: it never ran
            raise
        except Exception:
            unfinished_reason = "error"
            raise
        finally:
            if unfinished_reason is not None:
                self.finished.labels(self.model_name, unfinished_reason).inc(num_choices)
            await stream.aclose()
