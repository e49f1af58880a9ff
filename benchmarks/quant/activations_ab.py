"""Single-sequence decode of the default model's Q4_1 file with each --cpu-gguf-activations kind, in
one process, alternating the kinds round by round (the machine's load moves between processes and
minutes; within a round the kinds see the same load). Each kind is set on the loaded model's
matmuls as the runner sets it, and the fused decoder layers rebind their formats.

TPOT = (E2E - TTFT) / 127 for 128 new tokens after a 128-token prompt (prefix-cached after the first
round, so TTFT is one step), 2 threads.

python benchmarks/quant/activations_ab.py --rounds 10 --out benchmarks/quant/s11/activations-ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from engine import LLM, SamplingParams

KINDS = ("float", "int16", "int8")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    llm = LLM(None, num_threads=args.threads, max_model_len=512)
    model = llm.engine.runner.model
    matmuls = [m for m in model.modules() if getattr(m, "quant_format", None) is not None and hasattr(m, "activations")]
    fused = getattr(model.model, "fused_layers", None)
    prompt = list(range(100, 228))
    one, full = (SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 128))
    tok_s: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(args.rounds):
        for kind in KINDS:
            for m in matmuls:
                m.activations = None if kind == "float" else kind
            if fused is not None:
                fused._bound_to = None  # rebind: the formats carry the activation kind
            llm.generate([prompt], one, use_tqdm=False)  # warm: the prompt cached, the kernels built
            start = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            ttft = time.perf_counter() - start
            start = time.perf_counter()
            llm.generate([prompt], full, use_tqdm=False)
            tok_s[kind].append(127 / (time.perf_counter() - start - ttft))
    ratios = {k: statistics.median(a / b for a, b in zip(tok_s[k], tok_s["float"])) for k in KINDS}
    result = {"rounds": args.rounds, "threads": args.threads, "tok_s": tok_s,
              "median_tok_s": {k: statistics.median(v) for k, v in tok_s.items()},
              "median_round_ratio_to_float": ratios, "load_average_end": os.getloadavg()}
    print(json.dumps({k: result[k] for k in ("median_tok_s", "median_round_ratio_to_float", "load_average_end")}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
