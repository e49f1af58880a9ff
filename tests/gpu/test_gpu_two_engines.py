"""Two engines in one process on one GPU: the second sizes its KV cache from what is really free
(the whole device x its utilization, minus everything already in use, the first engine included),
and both keep generating what transformers generates, interleaved."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.hf_oracle import hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FIRST_UTIL, SECOND_UTIL = 0.3, 0.6
# What the allocator rounds and the profile run does not see (cuBLAS workspaces, a few graphs).
SLACK = 256 << 20


def _check(llm: LLM, path: str, seed: int) -> None:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 40, 90)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 8)


def test_two_engines_in_one_process(gpu_tiny_models):
    a_path, b_path = gpu_tiny_models("llama"), gpu_tiny_models("qwen3")
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    if total - free > 0.1 * total:
        pytest.skip(f"{(total - free) / 2**30:.1f} GiB of the GPU is already in use: the budgets would not say much")
    with LLM(a_path, device="cuda", dtype="float32", gpu_memory_utilization=FIRST_UTIL, max_model_len=512) as a:
        _check(a, a_path, 0)
        with LLM(b_path, device="cuda", dtype="float32", gpu_memory_utilization=SECOND_UTIL,
                 max_model_len=512) as b:
            free, total = torch.cuda.mem_get_info()
            used = total - free
            assert used <= SECOND_UTIL * total + SLACK, (
                f"the process uses {used / 2**30:.2f} GiB, more than the second engine's "
                f"{SECOND_UTIL} x {total / 2**30:.1f} GiB: it budgeted without counting what was in use")
            assert b.engine.runner.num_blocks > 0
            _check(b, b_path, 1)
            _check(a, a_path, 2)  # the first still works after the second was built and ran
