"""The pipeline driver's C heap: one glibc arena for all of its threads.

The driver runs Ray Data's executor, Ray's own threads and MLflow's each in a thread of its own, and glibc gives
each thread an arena of its own (up to eight a core). Memory that one thread frees stays in its arena, out of
reach of the others: freed by the executor's thread, then asked for again by the main thread's summary, it
counts twice. With one arena the driver's peak over ingest, normalize and dedup grows about a third as much
with the corpus, in the same seconds (docs/benchmarks.md, "The driver over ingest, normalize and dedup").

pipelines/full.py calls it first, when run as the driver: glibc fixes which arena a thread uses when the thread
first allocates, and pyarrow's import starts two threads.
"""

from __future__ import annotations

import ctypes
import os

M_ARENA_MAX = -8  # glibc's malloc.h


def one_arena() -> bool:
    """Every thread of this process allocates from one glibc arena from here on (call it before threads
    start). False where it does not apply: a C library without `mallopt` (macOS), or MALLOC_ARENA_MAX set in
    the environment (the person's own setting stands)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return mallopt(M_ARENA_MAX, 1) == 1
