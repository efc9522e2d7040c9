"""Memory a process freed, given back to the system.

glibc keeps freed memory in its heaps (its arenas: one per thread that allocated) unless a free leaves a large
enough block at a heap's top; after a request that read and sketched a wide module, a worker's RSS stayed 1 GB up
for good. `trim()` asks glibc to return every heap's free pages (`malloc_trim(0)`); the web app calls
it after each expensive call and each in-process ingest job (webapp/context.py, webapp/jobs.py). Elsewhere (no
glibc) it does nothing."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading

from zoo import config

_lock = threading.Lock()


@functools.cache  # looked up once
def _malloc_trim() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


def trim() -> bool:
    """Return the heaps' free memory to the system; whether glibc's malloc_trim was there to do it."""
    libc = _malloc_trim()
    if libc is None or not config.MALLOC_TRIM.get():  # 0: off (to measure what it gives back)
        return False
    with _lock:  # one trim at a time: each walks every arena
        libc.malloc_trim(0)
    return True


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process (Linux), 0 where /proc has none."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
