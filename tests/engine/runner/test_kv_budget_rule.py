"""The CUDA KV budget (ModelRunner._cuda_kv_budget), run on CPU with torch.cuda's memory queries
replaced by a fake device: vLLM's rule (total x gpu_memory_utilization, minus everything in use as
mem_get_info sees it, minus the profiled activation peak), the profile step it measures (a full
token budget over max_num_seqs sampled rows, prompt logprobs over a whole chunk), and the error
naming the knob when no block fits. The real device is tested in tests/gpu."""

from __future__ import annotations

import pytest
import torch

from engine import LLM

MiB = 1 << 20


class FakeDevice:
    def __init__(self, total: int, in_use: int, peak: int):
        self.total, self.in_use, self.peak = total, in_use, peak
        self.profiled = False

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
            monkeypatch.setattr(cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(cuda, "memory_allocated", lambda *a, **k: 10 * MiB)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda *a, **k: 10 * MiB + self.peak)
        monkeypatch.setattr(cuda, "mem_get_info", lambda *a, **k: (self.total - self.in_use, self.total))


@pytest.fixture
def runner(tiny_models):
    llm = LLM(tiny_models("llama"), device="cpu", num_kv_blocks=64, max_num_seqs=6, max_num_batched_tokens=40,
              max_model_len=256, max_logprobs=3, gpu_memory_utilization=0.5)
    runner = llm.engine.runner
    yield runner
    runner.num_blocks = 64  # the profile bound a throwaway cache and then none
    runner._allocate_kv_cache()


def test_budget_is_total_times_utilization_minus_in_use_and_peak(runner, monkeypatch):
    device = FakeDevice(total=1000 * MiB, in_use=300 * MiB, peak=50 * MiB)
    device.install(monkeypatch)
    sampled, scored = [], []
    sample, prompt_logprobs = runner.outputs.sample, runner.outputs.prompt_logprobs

    def spy_sample(out, logits, streams):
        sampled.append((logits.shape[0], {s.sampling_params.logprobs for s in streams}))
        return sample(out, logits, streams)

    def spy_prompt_logprobs(out, state, first, rows):
        scored.append(rows.shape[0])
        return prompt_logprobs(out, state, first, rows)

    monkeypatch.setattr(runner.outputs, "sample", spy_sample)
    monkeypatch.setattr(runner.outputs, "prompt_logprobs", spy_prompt_logprobs)
    assert runner._cuda_kv_budget() == 500 * MiB - 300 * MiB - 50 * MiB
    # One step: 40 tokens over 6 sequences (35 + 5 x 1), every one sampling with 3 logprobs; the
    # first's 35-token chunk scores 34 prompt tokens.
    assert sampled == [(6, {3})] and scored == [34]
    assert not runner.requests and all(s is None for s in runner.inputs._owners), "the profile left streams behind"


def test_no_block_left_names_the_knobs(runner, monkeypatch):
    FakeDevice(total=1000 * MiB, in_use=480 * MiB, peak=20 * MiB).install(monkeypatch)
    with pytest.raises(ValueError, match="gpu_memory_utilization.*kv_cache_memory / num_kv_blocks"):
        runner._cuda_kv_budget()
