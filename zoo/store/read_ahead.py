"""Reading files into the page cache ahead of their use, so that a loop of read-then-compute (zoo embed: a chunk of
adapters' blobs read through memory maps, then sketched) reads the next chunk from disk while it computes this one.

A blob is read through a private memory map (zoo/store/blobs.py `mapped_tensors`), so the compute faults its pages in
as it touches them, a fault at a time, and waits on each; a real-size adapter's blob is 50-170 MB. Asking the kernel
to read it first (`posix_fadvise(WILLNEED)`) queues the reads; a call returns once its reads are queued, which waits
while the device's queue is full (5.1 GB asked for in 1.95 s here, 0.31 s of it CPU), so the calls run on a thread of
their own and the pages arrive while the caller works. Nothing is copied into the process, so its memory does not
grow: the pages are the page cache's, evicted as any other when memory is short."""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

#: bytes asked for per `posix_fadvise` call: the kernel reads at most max(the device's readahead, its largest request)
#: per call (8 MiB and 4 MiB on this project's machines; 128 KiB and 1,280 KiB are common defaults), so a longer
#: range in one call would be cut short
WINDOW = 1 << 20


def read_into_cache(path: Path) -> int:
    """Ask the kernel to read a whole file into the page cache, a WINDOW at a time; returns its bytes. A file that
    cannot be opened is skipped (its reader reports it); where the platform has no posix_fadvise, nothing is done."""
    if not hasattr(os, "posix_fadvise"):
        return 0
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    try:
        size = os.fstat(fd).st_size
        for offset in range(0, size, WINDOW):
            os.posix_fadvise(fd, offset, min(WINDOW, size - offset), os.POSIX_FADV_WILLNEED)
        return size
    finally:
        os.close(fd)


class ReadAhead:
    """Files read into the page cache on one background thread, in the order they are added. Use as a context
    manager: leaving it waits until every file added has been asked for (the kernel's reads go on after)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zoo-read-ahead")

    def add(self, paths: Sequence[Path]) -> None:
        """Queue these files to be read after those added before."""
        for path in paths:
            self._pool.submit(read_into_cache, path)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
