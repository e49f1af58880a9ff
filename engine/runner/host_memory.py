"""Keep freed host memory in the process instead of handing it back to the kernel (glibc only).

A CPU forward allocates and frees megabyte-sized activations by the hundred. With glibc's
defaults, blocks that large are mmap()ed and munmap()ed each time, or trimmed off the heap top,
so every step page-faults its activations in again (and the kernel zeroes each page). Measured
on the default model, bf16, 2 cores: the first prefill steps took 1.6-2.2x the steady ones, and
every step paid some of it. Raising the mmap and trim thresholds makes freed blocks reusable,
which is what the tcmalloc/jemalloc that vLLM's CPU guide preloads does. The cost: the process
keeps its peak heap instead of shrinking after a burst.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit; larger blocks (the KV cache) still get their own mmap
_TOP_PAD = 64 << 20  # grow the heap in steps of this much instead of one page-faulting sbrk per block

_done = False


def keep_freed_memory() -> bool:
    """Apply once per process; True if glibc took the settings."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other libcs: no mallopt, nothing to tune
        return False
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX), (_M_TRIM_THRESHOLD, 2 ** 31 - 1), (_M_TOP_PAD, _TOP_PAD)))
    if not ok:
        logger.warning("glibc refused the malloc settings; CPU steps will page-fault their activations")
    _done = ok
    return ok

