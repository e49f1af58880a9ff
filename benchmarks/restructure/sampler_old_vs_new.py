"""The batched sampler (engine/sampler.py) against the per-row one it replaced, in one process, on
the same logits. Get the old one first, then run this from the repository root:

    git show 5da173f:engine/sampler.py > /tmp/old_sampler.py
    python benchmarks/restructure/sampler_old_vs_new.py
"""

import importlib.util
import sys
import time

import torch

import engine.sampler as new
from engine.model_runner import CachedRequestState
from engine.sampling_params import SamplingParams
from engine.scheduler_output import NewRequestData

spec = importlib.util.spec_from_file_location("old_sampler", "/tmp/old_sampler.py")
old = importlib.util.module_from_spec(spec)
sys.modules["old_sampler"] = old
spec.loader.exec_module(old)
torch.set_num_threads(2)
B, V = 64, 49152
logits = torch.randn(B, V)
CASES = {
    "greedy": dict(temperature=0.0),
    "temp1": dict(temperature=1.0),
    "top_p0.95": dict(temperature=0.8, top_p=0.95),
    "top_k40": dict(temperature=0.8, top_k=40),
    "penalties": dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
    "seeded": dict(temperature=1.0, seed=1),
}
for name, kw in CASES.items():
    ms = []
    for mod in (old, new):
        # The runner's streams: what both samplers read (and keep their generators and counts on).
        reqs = [CachedRequestState(NewRequestData(f"{i}#0", 0, list(range(100)), [], SamplingParams(**kw), [], 0))
                for i in range(B)]
        for r in reqs:
            r.output_token_ids = list(range(200, 456))
        sampler = mod.Sampler([2], 0, torch.device("cpu"))
        sampler(logits, reqs)
        start, n = time.perf_counter(), 5
        for _ in range(n):
            for r in reqs:
                r.output_token_ids.append(7)
            sampler(logits, reqs)
        ms.append((time.perf_counter() - start) / n * 1000)
    print(f"{name:10s} old {ms[0]:7.1f} ms  new {ms[1]:7.1f} ms  speedup {ms[0] / ms[1]:5.2f}x")
