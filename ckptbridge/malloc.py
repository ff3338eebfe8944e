"""Freed memory reused by every thread, within bounds, instead of faulted in afresh.

A conversion passes pieces of a few MiB to tens of MiB from thread to thread (our workers read
and rearrange them, TensorStore's threads encode, decode and copy them). glibc's defaults serve
that badly in two ways:

* each thread allocates from an arena of its own and keeps what it frees there, so peak RSS grew
  with the worker count well past the memory budget (orbax-to-safetensors of a 4.8 GB model with
  13 workers: 1.85 GB);
* blocks above the mapping threshold are mapped on their own and unmapped when freed, so the
  next piece's pages are faulted in and zero-filled again: ``clear_page`` was 44% of the CPU of
  orbax-to-safetensors and 22% of safetensors-to-orbax on a 2-core machine, and on a TPU VM's
  sandbox, where a first touch costs more, the largest share of the wall time
  (docs/benchmarks.md).

:func:`reuse_freed_memory` sets one arena for every thread (:data:`ARENAS`: what one thread
frees, any other reuses, so memory follows what is in use at once, not the thread count), the
mapping threshold at glibc's largest (:data:`MMAP_THRESHOLD`, 32 MiB: pieces below it come from
that arena and are reused) and the trim threshold at :data:`TRIM_THRESHOLD` (free memory at the
arena's top is kept up to that much for the next pieces rather than handed back and faulted in
again). A setting given in the environment (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_`` or the ``GLIBC_TUNABLES`` of the same names) is left as it is;
elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os

# glibc's mallopt parameters
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

ARENAS = 1
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 64 << 20  # two pieces of the default chunk size (32 MiB)

# (mallopt parameter, value, environment variable, tunable) of each setting
SETTINGS = (
    (M_ARENA_MAX, ARENAS, "MALLOC_ARENA_MAX", "glibc.malloc.arena_max"),
    (M_MMAP_THRESHOLD, MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", "glibc.malloc.mmap_threshold"),
    (M_TRIM_THRESHOLD, TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", "glibc.malloc.trim_threshold"),
)


def _given(variable: str, tunable: str, environ=os.environ) -> bool:
    return variable in environ or tunable + "=" in environ.get("GLIBC_TUNABLES", "")


@functools.cache
def reuse_freed_memory() -> bool:
    """Apply :data:`SETTINGS` not given in the environment (once per process). True where glibc
    took them (or the environment gives them all)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value, variable, tunable in SETTINGS
               if not _given(variable, tunable))
