"""Reading blobs into the page cache ahead of their use (zoo/store/read_ahead.py): a file evicted from the cache is
back in it after `ReadAhead` asked for it, whole, without the process reading a byte of it. Residency is the
kernel's own answer (mincore on a map of the file)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from zoo.store.blobs import BlobStore
from zoo.store.read_ahead import WINDOW, ReadAhead

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="page-cache residency is read with Linux's mincore")


def resident_share(path: Path) -> float:
    """The share of the file's pages in the page cache: mincore on a read-only shared map of it, which touches none."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            if libc.mincore(address, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec) / pages


def evicted(path: Path) -> bool:
    """Ask the kernel to drop the file's clean pages from the cache; whether it did (a tmpfs keeps them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_share(path) < 0.05


def test_read_ahead_brings_an_evicted_blob_back_into_the_cache(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    digest = "ab" * 32
    path = blobs.path(digest)
    path.parent.mkdir(parents=True)
    path.write_bytes(np.random.default_rng(0).standard_normal(3 * WINDOW // 4 + 12_345).astype(np.float32).tobytes())
    if not evicted(path):
        pytest.skip(f"{tmp_path}'s file system keeps pages the kernel is asked to drop: nothing to read ahead")
    with ReadAhead() as ahead:
        ahead.add(blobs.local_files([digest]))
    deadline = time.monotonic() + 10.0
    while resident_share(path) < 1.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert resident_share(path) == 1.0


def test_read_ahead_skips_a_missing_file_and_goes_on(tmp_path: Path) -> None:
    present = tmp_path / "present.bin"
    present.write_bytes(os.urandom(2 * WINDOW))
    if not evicted(present):
        pytest.skip(f"{tmp_path}'s file system keeps pages the kernel is asked to drop: nothing to read ahead")
    with ReadAhead() as ahead:
        ahead.add([tmp_path / "missing.bin", present])
    deadline = time.monotonic() + 10.0
    while resident_share(present) < 1.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert resident_share(present) == 1.0
