"""Memory that worker threads free goes back to the system.

glibc's allocator keeps what threads free: each thread allocates from its own arena, and blocks
below a threshold (which grows up to 32 MiB as larger blocks are freed) stay in those arenas for
reuse. A conversion whose workers each pass tensor pieces of a few MiB to tens of MiB through
their own arenas then holds several pieces per worker that it no longer uses: peak RSS grew with
the worker count well past the memory budget (orbax-to-safetensors of a 4.8 GB model with 13
workers: 1.85 GB, 0.49-0.54 GB with the threshold fixed; see docs/benchmarks.md). Fixing the
threshold at :data:`MMAP_THRESHOLD` maps every larger block on its own and returns it to the
system when it is freed. A ``MALLOC_MMAP_THRESHOLD_`` set in the environment is left as it is;
elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD = 8 << 20


@functools.cache
def return_freed_memory() -> bool:
    """Fix the allocator's mapping threshold (once per process). True where it is in effect."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
