"""Builds kernels/cpu_ops.cpp (load) and kernels/cpu_quant.cpp (load_quant) on first use (torch's
JIT extension builder, needs a C++ compiler) and caches each library under torch's extension
folder ($TORCH_EXTENSIONS_DIR to move it).

The library's name carries a hash of its source, the compile flags and the torch version, so an
edited kernel or an upgraded torch builds a fresh one instead of loading a stale binary. The
first build takes about half a minute; later processes load it in milliseconds (concurrent ones
wait on torch's build lock).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
QUANT_SOURCE = Path(__file__).with_name("cpu_quant.cpp")

# torch's vector-ISA names -> the flags its own kernels of that capability are compiled with.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

_lock = threading.Lock()
_module = None
_error: Exception | None = None
_quant_module = None
_quant_error: Exception | None = None


def _flags() -> list[str]:
    import torch

    isa = torch.backends.cpu.get_cpu_capability()
    if isa not in _ISA_FLAGS:
        isa = "DEFAULT"  # at::vec's portable fallback: correct everywhere, unvectorized
    return ["-O3", "-fopenmp", f"-DCPU_CAPABILITY={isa}", f"-DCPU_CAPABILITY_{isa}", *_ISA_FLAGS.get(isa, [])]


def _build(source_path: Path, prefix: str):
    import torch
    from torch.utils.cpp_extension import load_inline

    source = source_path.read_text()
    flags = _flags()
    digest = hashlib.sha256("\0".join([source, *flags, torch.__version__]).encode()).hexdigest()[:16]
    logger.info("loading the CPU kernels of %s (built on first use, about half a minute)", source_path.name)
    return load_inline(f"{prefix}_{digest}", cpp_sources=[source], extra_cflags=flags,
                       extra_ldflags=["-fopenmp"], verbose=os.environ.get("PAGEWISE_VERBOSE_BUILD") == "1")


def load():
    """The compiled module; raises RuntimeError saying why when it cannot be built."""
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise RuntimeError(f"the CPU kernels could not be built: {_error}") from _error
        try:
            _module = _build(SOURCE, "pagewise_cpu")
        except Exception as e:  # a missing compiler, headers, or a failed build: all mean "no CPU kernels"
            _error = e
            raise RuntimeError(f"the CPU kernels could not be built: {e}") from e
        return _module


def available() -> Exception | None:
    """None when the kernels load, else the reason they do not."""
    try:
        load()
    except RuntimeError as e:
        return e
    return None


def load_quant():
    """The compiled kernels/cpu_quant.cpp (matmuls on GGUF block-quantized weights); raises
    RuntimeError saying why when it cannot be built."""
    global _quant_module, _quant_error
    with _lock:
        if _quant_module is not None:
            return _quant_module
        if _quant_error is not None:
            raise RuntimeError(f"the quantized CPU kernels could not be built: {_quant_error}") from _quant_error
        try:
            _quant_module = _build(QUANT_SOURCE, "pagewise_cpu_quant")
        except Exception as e:  # as in load(): no compiler, headers, or a failed build
            _quant_error = e
            raise RuntimeError(f"the quantized CPU kernels could not be built: {e}") from e
        return _quant_module
