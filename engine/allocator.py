"""Host memory allocation for model processes: keep freed blocks for reuse instead of returning them to the OS.

A decode step on the CPU allocates and frees tensors of megabytes many times over: the logits of a verify
(tokens × 49,152 floats for the default target), their softmax, cumulative sums and masks. glibc's malloc
serves blocks above its mmap threshold (128 KiB at first, then adapting to at most 32 MiB) with fresh
``mmap`` pages and trims the top of its heap once 2× that threshold is free, so such temporaries go back to
the kernel on free and fault in again, page by page, on the next allocation: on a 2-core host that cost the
target's sampling several milliseconds per step (docs/benchmarks.md). PyTorch's CPU tuning guides swap in
jemalloc or tcmalloc for the same reason; with glibc the same effect is two ``mallopt`` settings: blocks up
to 32 MiB come from the heap, and freed memory stays in the process (its footprint is its peak, as with a
caching allocator). Larger blocks (KV caches, weights) are still mapped and unmapped on their own.

``SPECSERVE_MALLOC_TUNING=0`` leaves the C library's defaults; on a C library other than glibc nothing
changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to this size come from the heap
TRIM_THRESHOLD = 2**31 - 1  # the largest mallopt takes: the heap's free top is not trimmed below 2 GiB
ENV_SWITCH = "SPECSERVE_MALLOC_TUNING"


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to serve blocks up to 32 MiB from its heap and keep freed memory for reuse; returns
    whether the settings took effect (False with ``SPECSERVE_MALLOC_TUNING=0``, or without glibc). Call it
    once at process start, before the model allocates."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator stays as it is
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
