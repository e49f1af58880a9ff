"""Engine throughput with kernels/cpu_quant.cpp's helper pool (a probe for threads beside busy loops): the default
model's Q4_1 file, 64 prompts of 128 random tokens, 128 new tokens each (greedy, EOS ignored), as
`engine bench throughput` runs it in benchmarks/threads/shared_cpus.sh. Modes:
  default   the engine's own threads (the load follower)
  one       --num-threads 1
  helper    --num-threads 1 (torch's ops on the caller) and the quantized matmuls on the caller plus
            CPUs - 1 helpers that it never waits for (cpu_build.set_helpers; kernels/cpu_ops.cpp's loops too
            from the helper pool's change)

    python benchmarks/threads/helper_pool_ab.py MODE [OUT.json]
"""

from __future__ import annotations

import json
import os
import random
import sys
import time


def main() -> None:
    mode = sys.argv[1]
    from engine import LLM, SamplingParams
    from engine.loading.default_model import default_gguf_path
    from kernels import cpu_build

    llm = LLM(default_gguf_path(), **({} if mode == "default" else {"num_threads": 1}))
    if mode == "helper":
        cpu_build.set_helpers(len(os.sched_getaffinity(0)) - 1)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = dict(mode=mode, output_tok_s=tokens / seconds, seconds=seconds, tokens=tokens,
                  load=open("/proc/loadavg").read().split()[:3])
    print(json.dumps(result), flush=True)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(result, f)
    llm.shutdown()


if __name__ == "__main__":
    main()
