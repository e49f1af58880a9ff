"""Benchmark datasets: lists of `SampleRequest` (prompt token ids + wanted output length).

Prompts are drawn as token ids, not text, so every backend sees exactly the same input:
the parent process draws them once and hands the same list to each backend.

- random: ids drawn uniformly from the tokenizer's ordinary vocabulary (no special or
  added tokens); lengths uniform in [len * (1 - range_ratio), len * (1 + range_ratio)],
  as in vLLM's RandomDataset.
- sharegpt: a ShareGPT-format JSON file; the first human turn is the prompt and the
  token length of the following gpt turn is the output length, as in vLLM's
  benchmark (conversations with fewer than two turns, or a prompt / output shorter
  than 4 tokens, are skipped).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class SampleRequest:
    prompt_token_ids: list[int]
    output_len: int
    prompt: str | None = None  # the text, where the dataset has one (ShareGPT)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def ordinary_token_ids(tokenizer) -> np.ndarray:
    """Every id the tokenizer knows except special and added tokens (chat markers, BOS, ...)."""
    excluded = set(tokenizer.all_special_ids)
    excluded.update(getattr(tokenizer, "added_tokens_decoder", {}).keys())
    ids = np.array([i for i in range(len(tokenizer)) if i not in excluded], dtype=np.int64)
    if ids.size == 0:
        raise ValueError("the tokenizer has no ordinary tokens to draw prompts from")
    return ids


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> np.ndarray:
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def random_requests(
    tokenizer, num_prompts: int, input_len: int, output_len: int,
    range_ratio: float = 0.0, seed: int = 0,
) -> list[SampleRequest]:
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("--num-prompts, --random-input-len and --random-output-len must be >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    vocab = ordinary_token_ids(tokenizer)
    in_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    return [
        SampleRequest(prompt_token_ids=rng.choice(vocab, size=int(n)).tolist(), output_len=int(m))
        for n, m in zip(in_lens, out_lens)
    ]


def sharegpt_requests(
    tokenizer, path: str, num_prompts: int, seed: int = 0,
    output_len: int | None = None, max_model_len: int | None = None,
) -> list[SampleRequest]:
    """vLLM's ShareGPT sampling: shuffle conversations (seeded), keep the first usable ones."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}} entries")
    convs = [d.get("conversations") or d.get("conversation") or [] for d in data if isinstance(d, dict)]
    convs = [c for c in convs if len(c) >= 2]
    random.Random(seed).shuffle(convs)
    out: list[SampleRequest] = []
    for conv in convs:
        if len(out) >= num_prompts:
            break
        prompt, completion = conv[0].get("value", ""), conv[1].get("value", "")
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
        n_out = output_len or len(tokenizer(completion, add_special_tokens=False).input_ids)
        if len(ids) < 4 or n_out < 4:  # vLLM prunes sequences that are too short
            continue
        if max_model_len is not None and len(ids) + n_out > max_model_len:
            continue
        out.append(SampleRequest(prompt_token_ids=ids, output_len=n_out, prompt=prompt))
    if len(out) < num_prompts:
        raise ValueError(f"{path}: only {len(out)} usable conversations, asked for {num_prompts}")
    return out


def build_requests(args, tokenizer, max_model_len: int | None = None) -> list[SampleRequest]:
    """The dataset the CLI arguments describe (`--dataset-name`, resolved by the runner)."""
    name = getattr(args, "dataset_name", None) or ("sharegpt" if args.dataset_path else "random")
    if name == "sharegpt":
        return sharegpt_requests(
            tokenizer, args.dataset_path, args.num_prompts, args.seed,
            output_len=args.sharegpt_output_len, max_model_len=max_model_len,
        )
    return random_requests(
        tokenizer, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed,
    )


def save_requests(requests: list[SampleRequest], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump([asdict(r) for r in requests], f)


def load_requests(path: str) -> list[SampleRequest]:
    with open(path, encoding="utf-8") as f:
        return [SampleRequest(**r) for r in json.load(f)]
