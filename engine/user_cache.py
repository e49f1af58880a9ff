"""The user cache folder pagewise writes what it derives once and reuses: the default model's
converted folder (engine/default_model.py), GGUF tokenizers converted by transformers
(engine/gguf_loader.py), the llama.cpp peer's files (engine/bench)."""

from __future__ import annotations

import os


def cache_dir() -> str:
    """$PAGEWISE_CACHE_DIR, else $XDG_CACHE_HOME/pagewise, else ~/.cache/pagewise."""
    if d := os.environ.get("PAGEWISE_CACHE_DIR"):
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pagewise")
