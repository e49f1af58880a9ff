"""GPU tests: each module skips without CUDA (its own `pytestmark`), so CI collects them on CPU and
a GPU machine runs them (`python -m engine.bench.gpu_check` does). Tiny models as tests/engine's."""

from __future__ import annotations

import pytest

from tests.engine.conftest import FAMILIES
from tests.tiny_model import build_tiny_model


def graph_kwargs(eager: bool) -> dict:
    """EngineConfig arguments for CUDA graphs on (eager False) or off: vLLM's enforce_eager. Until the
    engine has that field, graphs cannot be switched: the eager case skips, the other runs as is."""
    from engine.bench.decode_anatomy import supports_graph_switch

    if supports_graph_switch():
        return {"enforce_eager": eager}
    if eager:
        pytest.skip("EngineConfig has no enforce_eager: CUDA graphs cannot be switched off")
    return {}


@pytest.fixture(scope="session")
def gpu_tiny_models(tmp_path_factory):
    """name -> folder of a tiny random model: tests/engine's FAMILIES, plus `name:key=value,...`
    overrides (e.g. "llama:num_hidden_layers=6"), each built once per test run."""
    cache = {}

    def get(name: str) -> str:
        if name not in cache:
            family, _, extra = name.partition(":")
            overrides = {k: int(v) for k, v in (kv.split("=") for kv in extra.split(",") if kv)}
            folder = tmp_path_factory.mktemp(name.replace(":", "-").replace(",", "-").replace("=", ""))
            cache[name] = build_tiny_model(folder, **{**FAMILIES[family], **overrides})
        return cache[name]

    return get
