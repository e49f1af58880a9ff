"""What the bench's modes share: parsers of the list-valued flags (cli.py declares the flags,
runner.py parses the ones that are checked together), the tokenizer that draws and counts
prompts, and the settings a report records. Light: argparse and json only, until a tokenizer
is loaded.
"""

from __future__ import annotations

import argparse
import json
import os

# Where every bench, load-test and soak output goes unless told otherwise: one folder the
# repository ignores (.gitignore), so running an example never leaves files to commit.
RESULTS_DIR = "bench-results"


def results_path(*parts: str) -> str:
    return os.path.join(RESULTS_DIR, *parts)


def cores() -> int:
    """The cores this process may run on (its affinity mask)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def peer_threads(args) -> int:
    """The threads a peer (transformers, vLLM, llama.cpp) computes with: --num-threads, else all cores."""
    return args.num_threads or cores()


def parse_percentiles(text: str) -> list[float]:
    """--metric-percentiles "50,90,99" -> [50.0, 90.0, 99.0], each in (0, 100)."""
    try:
        ps = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles takes numbers separated by commas, got {text!r}") from None
    if not ps or not all(0 < p < 100 for p in ps):
        raise ValueError(f"--metric-percentiles must lie in (0, 100), got {text!r}")
    return ps


def parse_concurrency_levels(text: str | None) -> list[int | None]:
    """--max-concurrency "1,8,32" -> [1, 8, 32]; none given -> [None] (one run, no limit)."""
    if not text:
        return [None]
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-concurrency takes integers like 8 or 1,8,32; got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"--max-concurrency levels must be >= 1; got {text!r}")
    return levels


def parse_servers(text: str) -> list[str]:
    """--launch "engine,vllm" -> ["engine", "vllm"]."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names or any(n not in ("engine", "vllm", "llamacpp") for n in names):
        raise argparse.ArgumentTypeError(f"--launch takes engine, vllm, llamacpp or a list like engine,llamacpp; "
                                         f"got {text!r}")
    return names


def parse_kv(items: list[str]) -> dict:
    """--vllm-arg KEY=VALUE items -> {key: value}, VALUE read as JSON where it is JSON, else text."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--vllm-arg takes KEY=VALUE, got {item!r}")
        try:
            out[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.replace("-", "_")] = value
    return out


def load_tokenizer(path: str):
    """A model folder's tokenizer, or a .gguf file's own (the file the engine and llama.cpp both read)."""
    import transformers

    if path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(path))
        return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return transformers.AutoTokenizer.from_pretrained(path)


def report_settings(args) -> dict:
    """The parsed flags as a report records them: internal ones left out, an API key hidden."""
    out = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("func",)}
    if out.get("api_key"):
        out["api_key"] = "<set>"  # a report is shared; the key stays out of it
    return out
