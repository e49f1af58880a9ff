"""Where `engine plan serve --gpu cpu` and the engine part: one process times the engine's own decode steps (the
default model, bf16, 128-token prompts) and, right after, the planner's measured step model for the same shape.

    python benchmarks/planner/step_gap.py

Per concurrency c: the engine step (whole), its model forward (layers and LM head) and the planner's step time.
The step minus the forward is the scheduler, sampler and bookkeeping; the forward minus the planner is what
the model code runs beyond the kernels measure.py times (its views, splits and module calls).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time

CONTEXT = 128 + 20  # the prompt and the decode steps taken before the timed ones


def engine_decode(core, forward: list[float], c: int, rng: random.Random) -> tuple[float, float]:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(c):
        core.add_request(f"{c}-{i}-{time.time()}", [rng.randrange(1000, 40000) for _ in range(128)], params)
    for _ in range(8):  # prefill and the first decodes
        core.step()
    steps, forwards = [], []
    for _ in range(25):
        forward[0] = 0.0
        start = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - start)
        forwards.append(forward[0])
    while core.has_unfinished_requests():
        core.step()
    return statistics.median(steps), statistics.median(forwards)


def main() -> int:
    from engine.bench.step_overhead import timed_forward
    from engine.frontend.llm import LLM
    from engine.loading.default_model import default_model_path
    from engine.planning.measure import measure_cpu
    from engine.planning.slo import decode_step_seconds
    from engine.planning.spec import ModelSpec

    path = default_model_path()
    with open(os.path.join(path, "config.json")) as f:
        spec = ModelSpec.from_hf_config(json.load(f))
    llm = LLM(path, dtype="bfloat16", kv_cache_memory=2 << 30)
    core = llm.engine
    rng = random.Random(0)
    with timed_forward(core.runner.model) as forward:
        for c in (1, 8, 32):
            load = os.getloadavg()
            step, fwd = engine_decode(core, forward, c, rng)
            device = measure_cpu(spec, "bfloat16", prompt=128, budget=2048)
            planned = decode_step_seconds(spec, device, c, CONTEXT, 2, 2)
            print(json.dumps({"concurrency": c, "load_average": load, "engine_step_ms": step * 1e3,
                              "engine_forward_ms": fwd * 1e3, "planner_step_ms": planned * 1e3}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
