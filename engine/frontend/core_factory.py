"""Where the core a front end (LLM, AsyncEngine) drives runs: in this process, or each replica in a
process of its own behind the same CoreClient calls (engine/frontend/data_parallel.py)."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.interface import CoreClient
from engine.frontend.data_parallel import DataParallelCore
from engine.frontend.startup import build_engine_core


def start_core(config: EngineConfig) -> CoreClient:
    """Processes of their own for data_parallel_size > 1 or core_process, else this process."""
    if config.data_parallel_size > 1 or config.core_process:
        return DataParallelCore(config)
    return build_engine_core(config)
