"""On CUDA, a decode step's forward never makes the host wait for the device: with
torch.cuda.set_sync_debug_mode("error") around it (inputs uploaded from pinned memory, block
table updated on the device, the layers or the graph replay, the LM head on the sample rows), any
synchronising call raises. With graphs on, every decode step replays a captured size; the greedy
tokens are those of the eager engine. Skipped without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _generate_strictly(path: str, enforce_eager: bool, num_prompts: int) -> tuple[list[list[int]], list]:
    """Greedy tokens of `num_prompts` prompts, every decode step's forward run under the strict
    sync mode; returns the tokens and each decode step's graph size (None: eager)."""
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=64, max_model_len=256, max_num_seqs=8,
              enforce_eager=enforce_eager)
    runner = llm.engine.runner
    assert bool(runner.graphs.graphs) != enforce_eager, "graphs are captured unless enforce_eager"
    forward, sizes = runner._forward, []

    def strict(step):
        if step.num_tokens != step.num_seqs:  # a prefill step: not the one under test
            return forward(step)
        torch.cuda.synchronize()  # nothing earlier may be blamed on the step
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = forward(step)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        sizes.append(step.graph_size)
        return out

    runner._forward = strict
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(20)] for _ in range(num_prompts)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], sizes


@pytest.mark.parametrize("num_prompts", [1, 4, 3])  # 3 runs padded to the captured size 4
def test_decode_forward_never_syncs_and_graphs_match_eager(gpu_tiny_models, num_prompts):
    path = gpu_tiny_models("llama")
    eager_tokens, eager_sizes = _generate_strictly(path, enforce_eager=True, num_prompts=num_prompts)
    graph_tokens, graph_sizes = _generate_strictly(path, enforce_eager=False, num_prompts=num_prompts)
    assert eager_sizes and all(s is None for s in eager_sizes)
    assert graph_sizes and all(s is not None and s >= num_prompts for s in graph_sizes)
    assert graph_tokens == eager_tokens
