"""The default model (SmolLM2-135M-Instruct, the shipped Q4_1 GGUF) served natively (engine/quant:
linear weights kept as Q4_1 blocks) against the same file dequantized to float (the converted HF
folder holds exactly gguf.quants.dequantize's values, what the dequantizing path loads).

  agreement   greedy tokens over a fixed prompt set (20 prompts x 100 tokens = 2,000 positions):
              each position's greedy choice given the reference's own prefix (teacher forcing,
              through prompt_logprobs), and free-running streams to their first difference. The
              native float32 engine runs with each --cpu-gguf-activations kind; the integer kinds
              score in 16-token chunks, so every position takes the small-step kernels a decode
              step takes.
  speed       single-sequence decode: TPOT = (E2E - TTFT) / (output_len - 1), native and
              dequantized bf16 alternating in one process, best and median of --repeats.

python benchmarks/quant/default_model.py [--skip-agreement] [--repeats 5] --out benchmarks/quant/default_model.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from engine import LLM, SamplingParams
from engine.loading.default_model import default_gguf_path, default_model_path

PROMPTS = [
    "The capital of France is", "Write a haiku about rain.", "Explain photosynthesis to a child.",
    "List three uses of a paperclip.", "What is 17 times 23?", "Once upon a time, in a small village,",
    "Give me a recipe for pancakes.", "Why is the sky blue?", "Translate 'good morning' into Spanish.",
    "Describe a cat in two sentences.", "What are the planets of the solar system?",
    "Write a short poem about the sea.", "How does a bicycle work?", "Summarize the plot of Hamlet.",
    "What is machine learning?", "Tell me a joke about computers.", "How do I boil an egg?",
    "Name five fruits that are red.", "What causes earthquakes?", "Write a limerick about a dog.",
]
OUTPUT_LEN = 100
ENGINE = dict(max_model_len=512, num_kv_blocks=512, seed=0)


def chat_ids(llm: LLM) -> list[list[int]]:
    tok = llm.tokenizer
    return [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                        add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            for p in PROMPTS]


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def forced(llm: LLM, prompts: list[list[int]], want: list[list[int]]) -> tuple[int, int]:
    outs = llm.generate([p + w for p, w in zip(prompts, want)],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    same = total = 0
    for prompt, tokens, out in zip(prompts, want, outs):
        for j, token in enumerate(tokens):
            position = out.prompt_logprobs[len(prompt) + j]
            same += max(position, key=position.get) == token
            total += 1
    return same, total


def free_running(a: list[list[int]], b: list[list[int]]) -> int:
    """Positions equal up to each stream's first difference, summed."""
    n = 0
    for sa, sb in zip(a, b):
        for x, y in zip(sa, sb):
            if x != y:
                break
            n += 1
    return n


def agreement() -> dict:
    gguf, folder = default_gguf_path(), default_model_path()
    runs = {}
    chunked = {"max_num_batched_tokens": 16}
    for name, path, dtype, settings in (
            ("dequant_f32", folder, "float32", {}), ("native_f32", gguf, "float32", {"cpu_gguf_activations": "float"}),
            ("native_f32_int16", gguf, "float32", {"cpu_gguf_activations": "int16", **chunked}),
            ("native_f32_int8", gguf, "float32", {"cpu_gguf_activations": "int8", **chunked}),
            ("dequant_bf16", folder, "bfloat16", {}),
            ("native_bf16", gguf, "bfloat16", {"cpu_gguf_activations": "float"})):
        llm = LLM(path, dtype=dtype, **ENGINE, **settings)
        prompts = chat_ids(llm)
        runs[name] = (llm, greedy(llm, prompts))
    report = {"positions": len(PROMPTS) * OUTPUT_LEN}
    for model, ref in (("native_f32", "dequant_f32"), ("native_f32_int16", "dequant_f32"),
                       ("native_f32_int8", "dequant_f32"), ("native_bf16", "dequant_bf16"),
                       ("native_bf16", "dequant_f32"), ("dequant_bf16", "dequant_f32")):
        same, total = forced(runs[model][0], prompts, runs[ref][1])
        report[f"{model}_vs_{ref}"] = {"forced_agree": same / total,
                                       "free_running_prefix": free_running(runs[model][1], runs[ref][1]) / total}
        print(model, "vs", ref, report[f"{model}_vs_{ref}"], flush=True)
    for llm, _ in runs.values():
        llm.shutdown()
    return report


def decode_speed(repeats: int, input_len: int, output_len: int) -> dict:
    gguf, folder = default_gguf_path(), default_model_path()
    llms = {"native_bf16": LLM(gguf, dtype="bfloat16", **ENGINE),
            "dequant_bf16": LLM(folder, dtype="bfloat16", **ENGINE),
            "native_f32": LLM(gguf, dtype="float32", **ENGINE),
            "dequant_f32": LLM(folder, dtype="float32", **ENGINE)}
    prompt = list(range(1000, 1000 + input_len))
    tpots: dict[str, list[float]] = {name: [] for name in llms}
    loads = []
    for _ in range(repeats + 1):  # the first round warms up (kernel build, oneDNN plans)
        for name, llm in llms.items():
            t = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            ttft = time.perf_counter() - t
            t = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True),
                         use_tqdm=False)
            tpots[name].append((time.perf_counter() - t - ttft) / (output_len - 1))
        loads.append(os.getloadavg())
    report = {"input_len": input_len, "output_len": output_len, "repeats": repeats, "loadavg": loads}
    for name, values in tpots.items():
        values = values[1:]
        report[name] = {"best_tok_s": 1 / min(values), "median_tok_s": 1 / statistics.median(values),
                        "tpot_ms": [1e3 * v for v in values]}
        print(name, {k: v for k, v in report[name].items() if k != "tpot_ms"}, flush=True)
    for llm in llms.values():
        llm.shutdown()
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-threads", type=int, default=None, help="the engine's num_threads (default: torch's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.num_threads:
        ENGINE["num_threads"] = args.num_threads
    result = {"loadavg_start": os.getloadavg()}
    if not args.skip_agreement:
        result["agreement"] = agreement()
    if not args.skip_speed:
        result["decode"] = decode_speed(args.repeats, args.input_len, args.output_len)
    result["loadavg_end"] = os.getloadavg()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
