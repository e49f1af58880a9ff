"""Offline backends for `engine bench throughput|latency`: one class per engine, same shape.

    backend = get_backend("engine")(args)
    backend.load()                      # start-up: weights, compile, KV cache (timed apart)
    token_ids = backend.generate(reqs)  # one list of generated ids per SampleRequest, in order
    backend.info()                      # versions and settings for the report

Every backend ignores EOS and generates exactly `output_len` tokens per request, greedily.
"""

from __future__ import annotations

BACKENDS = ("engine", "hf", "vllm", "llamacpp")


def get_backend(name: str):
    if name == "engine":
        from engine.bench.backends.engine import EngineBackend

        return EngineBackend
    if name == "hf":
        from engine.bench.backends.hf import HFBackend

        return HFBackend
    if name == "vllm":
        from engine.bench.backends.vllm import VLLMBackend

        return VLLMBackend
    if name == "llamacpp":
        from engine.bench.backends.llamacpp import LlamaCppBackend

        return LlamaCppBackend
    raise ValueError(f"unknown backend {name!r}; choose from {BACKENDS}")
