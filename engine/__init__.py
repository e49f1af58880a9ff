"""pagewise engine: paged KV cache, continuous batching, offline and async APIs.

Heavy modules (torch, transformers) load on first use so that light tools such as
`engine plan` start instantly.
"""

from engine.runner.cpu_threads import bound_openmp_spinning

# Before anything imports torch: OpenMP reads how long idle threads spin once, when torch loads it.
bound_openmp_spinning()

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "LoRARequest"]


def __getattr__(name):
    if name == "LLM":
        from engine.frontend.llm import LLM

        return LLM
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from engine.config import EngineConfig

        return EngineConfig
    if name == "LoRARequest":
        from engine.request import LoRARequest

        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput"):
        from engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
