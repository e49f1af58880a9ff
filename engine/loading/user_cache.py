"""The user cache folder pagewise writes what it derives once and reuses: the default model's
converted folder (engine/loading/default_model.py), GGUF tokenizers converted by transformers
(engine/loading/gguf_loader.py), the llama.cpp peer's files (engine/bench)."""

from __future__ import annotations

import fcntl
import glob
import os
import shutil
import tempfile
from collections.abc import Callable


def cache_dir() -> str:
    """$PAGEWISE_CACHE_DIR, else $XDG_CACHE_HOME/pagewise, else ~/.cache/pagewise."""
    if d := os.environ.get("PAGEWISE_CACHE_DIR"):
        return d
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pagewise")


def cached_folder(name: str, build: Callable[[str], None]) -> str:
    """cache_dir()/name (name may hold a subfolder), made once: build(tmp) fills a temporary folder
    beside it, which is then renamed into place whole, so a reader never sees half of one.
    Concurrent first calls (several server workers) wait on a lock while one builds; a temporary
    folder a process left when it died mid-build is removed. mkdtemp's 0700 is opened to
    0755/0644: the cache may be shared (built as root in an image, say). OSError where the cache
    cannot be written; whatever build raises, after removing its temporary folder."""
    final = os.path.join(cache_dir(), name)
    if os.path.isdir(final):  # only ever created by the rename below
        return final
    parent, base = os.path.split(final)
    os.makedirs(parent, exist_ok=True)
    with open(final + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isdir(final):
            return final
        for stale in glob.glob(os.path.join(parent, glob.escape(base) + ".tmp-*")):  # holding the lock: dead
            shutil.rmtree(stale, ignore_errors=True)
        tmp = tempfile.mkdtemp(prefix=base + ".tmp-", dir=parent)
        try:
            build(tmp)
            os.chmod(tmp, 0o755)
            for f in os.listdir(tmp):
                os.chmod(os.path.join(tmp, f), 0o755 if os.path.isdir(os.path.join(tmp, f)) else 0o644)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
