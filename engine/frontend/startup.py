"""The one place an engine replica is put together: open the model, build the executor (a
ModelRunner in one process, or rank 0 of a TP x PP replica, which starts the other ranks), and
hand it to the EngineCore that steps it. The offline LLM, AsyncEngine and each data-parallel
replica all start their core here (engine/frontend/core_factory.py says whether in this process or
behind pipes in processes of its own)."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.executor.executor import make_executor
from engine.loading.loader import source_for
from engine.runner.model_runner import resolve_device
from kernels import cpu_build


def build_engine_core(config: EngineConfig, core_class: type[EngineCore] = EngineCore) -> EngineCore:
    """`core_class`: EngineCore, or a subclass of it (tests inject failures that way)."""
    if _uses_cpu_kernels(config):
        cpu_build.start_building()  # the compilers run while the model loads
    source = source_for(config)
    executor = make_executor(config, source)
    try:
        return core_class(config, source, executor)
    except BaseException:
        # The core refused the settings (say, a max_model_len the KV cache cannot hold): stop
        # the worker processes a parallel executor already started, rather than leave them.
        stop = getattr(executor, "shutdown", None)
        if stop is not None:
            stop()
        raise


def _uses_cpu_kernels(config: EngineConfig) -> bool:
    return resolve_device(config.device).type == "cpu" and config.attention_backend in ("auto", "cpu")
