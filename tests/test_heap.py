"""core/heap.py: the driver's threads share one glibc arena."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT

# Four threads each allocate and free 1 MB, then glibc's malloc_stats() lists the process's arenas on stderr. Each
# holds its first block until all four have one: glibc gives a thread that starts after another ended the ended
# one's arena, so threads that ran one after another (a busy machine) would share one.
SCRIPT = """
import ctypes, sys, threading
from core.heap import one_arena
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
print(one_arena() if sys.argv[1] == "one" else None)
together = threading.Barrier(4)
def work():
    held = libc.malloc(4096)
    together.wait()
    for _ in range(50):
        libc.free(libc.malloc(1 << 20 if _ % 2 else 4096))
    libc.free(held)
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
libc.malloc_stats()
"""


def arenas(mode: str, env: dict) -> tuple[str, int]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip(), proc.stderr.count("Arena ")


def glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):  # macOS, musl: no such name
        return False


@pytest.mark.skipif(not glibc(), reason="glibc's arenas")
def test_one_arena_serves_every_thread_unless_malloc_arena_max_is_set():
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    assert arenas("one", env) == ("True", 1)
    said, without = arenas("default", env)
    assert said == "None" and without > 1  # each thread its own arena: what one_arena() stops
    assert arenas("one", {**env, "MALLOC_ARENA_MAX": "3"}) == ("False", 3)  # the person's own setting stands
