"""Builds kernels/cpu_ops.cpp (load), kernels/cpu_quant.cpp (load_quant) and kernels/cpu_lora.cpp
(load_lora) on first use (torch's JIT extension builder, needs a C++ compiler) and caches each
library in a folder of this Python environment's own under torch's extension folder
($TORCH_EXTENSIONS_DIR to move it): another virtual environment on the machine builds against its
own torch headers, and sharing one folder made each environment rebuild what the other had just
built.

The library's name carries a hash of its source, the compile flags and the torch version, so an
edited kernel or an upgraded torch builds a fresh one instead of loading a stale binary. An engine
on a CPU starts the first two builds at once (`start_building`), each compiler on its own core,
while the model loads (the LoRA library waits for the first LoRA call, so an engine serving no
adapters never builds it); later processes load the libraries in milliseconds (concurrent ones
wait on torch's build lock).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
QUANT_SOURCE = Path(__file__).with_name("cpu_quant.cpp")
LORA_SOURCE = Path(__file__).with_name("cpu_lora.cpp")

# torch's vector-ISA names -> the flags its own kernels of that capability are compiled with.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

_lock = threading.Lock()  # the helper-pool wiring between the two libraries


def _flags() -> list[str]:
    import torch

    isa = torch.backends.cpu.get_cpu_capability()
    if isa not in _ISA_FLAGS:
        isa = "DEFAULT"  # at::vec's portable fallback: correct everywhere, unvectorized
    return ["-O3", "-fopenmp", f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}", *_ISA_FLAGS.get(isa, [])]


def _build_root() -> Path:
    """This environment's folder under torch's extension folder."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions")
    environment = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    return Path(root) / f"pagewise-{environment}"


def _build(source_path: Path, prefix: str):
    import torch
    from torch.utils.cpp_extension import load_inline

    source = source_path.read_text()
    flags = _flags()
    digest = hashlib.sha256("\0".join([source, *flags, torch.__version__]).encode()).hexdigest()[:16]
    name = f"{prefix}_{digest}"
    folder = _build_root() / name
    folder.mkdir(parents=True, exist_ok=True)
    built = (folder / f"{name}.so").exists()
    if not built:
        logger.info("building the CPU kernels of %s for this environment (once; about a minute a file on 2 cores)",
                    source_path.name)
    start = time.perf_counter()
    module = load_inline(name, cpp_sources=[source], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                         build_directory=str(folder), verbose=os.environ.get("PAGEWISE_VERBOSE_BUILD") == "1")
    if not built:
        logger.info("built the CPU kernels of %s in %.0f s", source_path.name, time.perf_counter() - start)
    return module


class _Library:
    """One C++ source, built once per process on first use; a failed build is remembered, so
    every later call says why at once instead of building again."""

    def __init__(self, source: Path, prefix: str, what: str):
        self.source, self.prefix, self.what = source, prefix, what
        self.module = None
        self.error: Exception | None = None
        self.lock = threading.Lock()  # one per library, so that the two build at once

    def load(self):
        if self.module is not None:  # every kernel call asks: no lock once built
            return self.module
        with self.lock:
            if self.module is not None:
                return self.module
            if self.error is not None:
                raise RuntimeError(f"{self.what} could not be built: {self.error}") from self.error
            try:
                module = _build(self.source, self.prefix)
            except Exception as e:  # a missing compiler, headers, or a failed build: all mean "no kernels"
                self.error = e
                raise RuntimeError(f"{self.what} could not be built: {e}") from e
            with _lock:
                self.module = module
                _share_the_pool()
            return self.module


_OPS = _Library(SOURCE, "pagewise_cpu", "the CPU kernels")
_QUANT = _Library(QUANT_SOURCE, "pagewise_cpu_quant", "the quantized CPU kernels")
_LORA = _Library(LORA_SOURCE, "pagewise_cpu_lora", "the CPU LoRA kernels")


def start_building() -> None:
    """Build (or load) both libraries in background threads now, each compiler on a core of its
    own, so that an engine's first kernel call finds them ready or nearly so. A failed build is
    reported by that first call, as without this."""
    for library in (_OPS, _QUANT):
        if library.module is None and library.error is None:
            threading.Thread(target=_quietly, args=(library,), name=f"build-{library.prefix}", daemon=True).start()


def _quietly(library: _Library) -> None:
    try:
        library.load()
    except RuntimeError:
        pass  # remembered in library.error; the first kernel call raises it


def load():
    """The compiled kernels/cpu_ops.cpp; raises RuntimeError saying why when it cannot be built."""
    return _OPS.load()


def load_quant():
    """The compiled kernels/cpu_quant.cpp (matmuls on GGUF block-quantized weights); raises
    RuntimeError saying why when it cannot be built."""
    return _QUANT.load()


def load_lora():
    """The compiled kernels/cpu_lora.cpp (multi-LoRA shrink and expand); raises RuntimeError saying
    why when it cannot be built."""
    return _LORA.load()


_helpers = 0


def _share_the_pool() -> None:
    """(Under _lock, once a library loads.) cpu_quant.cpp's helper pool takes cpu_ops.cpp's loops too
    once both are loaded, and has the helpers set_helpers asked for."""
    if _QUANT.module is None:
        return
    _QUANT.module.set_helpers(_helpers)
    if _OPS.module is not None:
        _OPS.module.use_pool(_QUANT.module.parallel_for_address(), _QUANT.module.helpers_address())


def set_helpers(n: int) -> None:
    """Give the C++ kernels' loops `n` helper threads that their caller never waits for, beside
    torch's team (0: the team alone), now if kernels/cpu_quant.cpp's pool is loaded, else once it
    is: engine/runner/cpu_threads.LoadFollower asks for them on CPUs that other processes keep busy. The
    pool serves cpu_ops.cpp's loops too once both libraries are loaded; their results do not
    depend on it (tests/kernels/test_helper_pool.py)."""
    global _helpers
    with _lock:
        _helpers = n
        _share_the_pool()


def helpers() -> int:
    """set_helpers' count."""
    return _helpers


def available() -> Exception | None:
    """None when the kernels load, else the reason they do not."""
    try:
        load()
    except RuntimeError as e:
        return e
    return None
