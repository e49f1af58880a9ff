"""CoreClient is the whole of what the front end calls on a core: one EngineCore and the
data-parallel front both provide every member of it, with the Protocol's parameters, and the front
end calls them directly, never probing the core for optional ones."""

from __future__ import annotations

import inspect
import os
import re

import pytest

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.interface import CoreClient
from engine.frontend.data_parallel import DataParallelCore
from engine.frontend.startup import build_engine_core

FRONTEND = os.path.join(os.path.dirname(__file__), "..", "..", "..", "engine", "frontend")
METHODS = sorted(n for n, v in vars(CoreClient).items() if inspect.isfunction(v) and not n.startswith("_"))
ATTRIBUTES = sorted(CoreClient.__annotations__)


def test_the_protocol_names_what_the_front_end_calls():
    assert METHODS == ["abort_request", "add_request", "check_health", "check_lora", "check_request",
                       "finish_choice", "has_unfinished_requests", "shutdown", "stats", "step"]
    assert ATTRIBUTES == ["max_model_len", "model_name", "sampling_defaults", "tokenizer"]


@pytest.mark.parametrize("core_class", [EngineCore, DataParallelCore])
def test_each_core_defines_every_method_with_the_protocols_parameters(core_class):
    for name in METHODS:
        wanted = list(inspect.signature(getattr(CoreClient, name)).parameters)
        got = list(inspect.signature(getattr(core_class, name)).parameters)
        assert got[:len(wanted)] == wanted, (core_class.__name__, name)


def test_a_built_engine_core_is_a_core_client(tiny_model_dir):
    core = build_engine_core(EngineConfig(model=tiny_model_dir, device="cpu", num_kv_blocks=64, num_threads=1))
    try:
        assert isinstance(core, CoreClient)
        core.check_health()  # one process: nothing to lose, nothing raised
    finally:
        core.shutdown()


@pytest.mark.slow
def test_a_data_parallel_core_is_a_core_client(tiny_model_dir):
    core = DataParallelCore(EngineConfig(model=tiny_model_dir, device="cpu", data_parallel_size=2, num_kv_blocks=64,
                                         num_threads=1))
    try:
        assert isinstance(core, CoreClient)
        core.check_health()
    finally:
        core.shutdown()


def test_the_front_end_never_probes_its_core():
    probe = re.compile(r"getattr\((self\._core|self\.engine|core)\b")  # AsyncEngine's, LLM's and local names
    probes = []
    for name in sorted(os.listdir(FRONTEND)):
        if name.endswith(".py"):
            text = open(os.path.join(FRONTEND, name)).read()
            probes += [f"{name}: {m.group(0)}" for m in probe.finditer(text)]
    assert probes == []
