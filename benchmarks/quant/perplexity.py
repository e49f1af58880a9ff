"""Perplexity of a model on a fixed text, for each weight quantization asked for (--quantization
none / int8 / int4 with its group size), and each one's change against the first.

The text (default: perplexity_text.txt beside this file, ~700 words of public-domain prose plus
plain technical sentences) is tokenized once, cut into non-overlapping windows of --window tokens,
and each window scored by the engine in one prefill: prompt_logprobs gives log p(token | its prefix)
for every token after the window's first. Perplexity = exp(-(sum of those) / their count).

python benchmarks/quant/perplexity.py [--model FOLDER] [--configs none,int8,int4:128,int4:32,int4:32+head] \
    [--dtype float32] --out benchmarks/quant/perplexity-default.json
(default model: the embedded SmolLM2-135M-Instruct, its float32 safetensors folder; `+head`: with
--quantize-lm-head, its tied embedding quantized too)

Configs `gguf-float`, `gguf-int16` and `gguf-int8` read the embedded model's own GGUF file (its
blocks as stored) instead of the folder, with that EngineConfig.cpu_gguf_activations, scored in
16-token chunks so that every row takes the small-step kernels a decode step takes (float: the
folder's numbers to summation order).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

from engine import LLM, SamplingParams
from engine.loading.default_model import default_gguf_path, default_model_path

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "perplexity_text.txt")


def parse_config(text: str) -> tuple[str | None, int]:
    """"none" | "int8" | "int4" | "int4:32" -> (quantization, group size)."""
    method, _, group = text.partition(":")
    return (None if method == "none" else method), int(group or 128)


def engine_source(spec: str, model: str) -> tuple[str, dict]:
    """The model path and the engine settings of a --configs entry."""
    if spec.startswith("gguf-"):
        return default_gguf_path(), {"cpu_gguf_activations": spec[5:], "max_num_batched_tokens": 16}
    spec, head = spec.removesuffix("+head"), spec.endswith("+head")
    quantization, group = parse_config(spec)
    return model, {"quantization": quantization, "quantization_group_size": group, "quantize_lm_head": head}


def perplexity(llm: LLM, ids: list[int], window: int) -> tuple[float, int]:
    windows = [ids[i:i + window] for i in range(0, len(ids), window)]
    windows = [w for w in windows if len(w) > 1]
    outs = llm.generate(windows, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll, count = 0.0, 0
    for w, out in zip(windows, outs):
        for position, token in enumerate(w[1:], start=1):
            nll -= out.prompt_logprobs[position][token]
            count += 1
    return math.exp(nll / count), count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: the embedded model's float32 folder)")
    p.add_argument("--configs", default="none,int8,int4:128,int4:32")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--text", default=TEXT)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = args.model or default_model_path()
    with open(args.text) as f:
        text = f.read()
    rows = []
    for spec in args.configs.split(","):
        path, settings = engine_source(spec, model)
        quantization, group = settings.get("quantization"), settings.get("quantization_group_size")
        start = time.perf_counter()
        try:
            llm = LLM(path, dtype=args.dtype, max_model_len=args.window + 1, num_kv_blocks=4 * args.window // 16 + 16,
                      seed=0, **settings)
        except ValueError as e:  # e.g. a group size that does not divide the model's inputs: recorded
            rows.append({"config": spec, "refused": str(e)})
            print(f"{spec:10s} refused: {e}", flush=True)
            continue
        try:
            layers = [m for m in llm.engine.runner.model.modules() if getattr(m, "quant_format", None) is not None]
            if quantization is not None and not layers:
                raise SystemExit(f"--quantization {quantization} reached no layer: EngineConfig.quantization is not "
                                 "wired into resolve_model")
            ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
            ppl, count = perplexity(llm, ids, args.window)
        finally:
            llm.shutdown()
        rows.append({"config": spec, "model": path, "quantization": quantization,
                     "group_size": group if quantization == "int4" else None, "perplexity": ppl, "tokens_scored": count,
                     "formats": sorted({m.quant_format.name for m in layers}),
                     "seconds": round(time.perf_counter() - start, 1)})
        first = next(r for r in rows if "perplexity" in r)
        rows[-1]["delta_vs_first"] = ppl / first["perplexity"] - 1
        print(f"{spec:10s} perplexity {ppl:9.4f}  ({100 * rows[-1]['delta_vs_first']:+.2f}% vs {first['config']})  "
              f"{count} tokens, {rows[-1]['seconds']} s", flush=True)
    result = {"model": model, "dtype": args.dtype, "text": os.path.basename(args.text), "window": args.window,
              "load_average": os.getloadavg(), "results": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
