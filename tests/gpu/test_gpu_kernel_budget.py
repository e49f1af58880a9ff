"""Kernels per decode step, counted by torch.profiler on the GPU (engine.bench.decode_anatomy):
without CUDA graphs at most 12 per layer, measured as the slope between a 2-layer and a 6-layer
model so that the step's fixed part (embedding, LM head, sampler, input copies) cancels, and that
fixed part bounded too; with graphs one graph launch per step."""

from __future__ import annotations

import pytest
import torch

from engine.bench.decode_anatomy import build_engine, measure_batch, supports_graph_switch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

KERNELS_PER_LAYER = 12  # the target: the fused kernels bring ~34 per layer down to this
FIXED_KERNELS = 40  # embedding, final norm, LM head, sampling, the step's input and output copies
BATCH, CONTEXT, STEPS = 4, 64, 4


def _row(path: str, eager: bool) -> dict:
    # Without the enforce_eager field the engine has no graphs: its default is the eager step.
    llm = build_engine(path, BATCH, CONTEXT, 16, "bfloat16", eager if supports_graph_switch() else None, "triton")
    with llm:
        return measure_batch(llm, BATCH, CONTEXT, STEPS, 3)


def test_eager_decode_step_kernels_per_layer(gpu_tiny_models):
    shallow = _row(gpu_tiny_models("llama:num_hidden_layers=2"), eager=True)
    deep = _row(gpu_tiny_models("llama:num_hidden_layers=6"), eager=True)
    per_layer = (deep["kernels_per_step"] - shallow["kernels_per_step"]) / 4
    fixed = shallow["kernels_per_step"] - 2 * per_layer
    assert per_layer <= KERNELS_PER_LAYER, f"{per_layer:.1f} kernels per layer (deep {deep}, shallow {shallow})"
    assert fixed <= FIXED_KERNELS, f"{fixed:.0f} kernels outside the layers"


def test_graphed_decode_step_is_one_graph_launch(gpu_tiny_models):
    if not supports_graph_switch():
        pytest.skip("EngineConfig has no enforce_eager: no CUDA graphs to count")
    row = _row(gpu_tiny_models("llama"), eager=False)
    assert row["graph_launches_per_step"] == 1, row
