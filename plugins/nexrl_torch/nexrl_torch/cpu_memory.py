"""Keep the memory torch frees inside the process (glibc's malloc), so it is reused without page faults.

By default glibc returns large freed blocks to the kernel (each over its mmap threshold is its
own mapping; the heap top is trimmed; a thread's arena holds at most 64 MiB per heap). A training
step and a generation allocate and free the same few GB every time, and the kernel then faults
each page back in, zeroed: 0.3-0.6 million minor faults per quickstart step on the CPU. With one
arena, no mmap'd blocks and no trimming, after the first steps a step faults almost nothing.
The numbers computed do not change; the process keeps its peak size instead of shrinking
between steps. Process-wide and irreversible, so an opt-in: applied once, by the first
model-holding part built with ``keep_freed_memory: true`` (default false).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

from loguru import logger

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

_lock = threading.Lock()
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings above once per process; True when they are in force (False where the C
    library has no ``mallopt``, e.g. not glibc)."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _mallopt_keep()
        return _applied


def _mallopt_keep() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        logger.debug("keep_freed_memory: no mallopt in this C library; left as it is")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # One arena: a block one thread frees serves the next thread's request of that size, and no
    # block is too large for the arena's heap. No mmap'd blocks, no trimming: nothing goes back.
    done = [mallopt(_M_ARENA_MAX, 1), mallopt(_M_MMAP_MAX, 0), mallopt(_M_TRIM_THRESHOLD, -1)]
    if not all(done):
        logger.debug(f"keep_freed_memory: mallopt refused some settings ({done}); left partly as it was")
        return False
    logger.debug("keep_freed_memory: freed memory stays in the process (one arena, no mmap, no trim)")
    return True
