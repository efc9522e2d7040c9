"""Content-addressed blob store for canonical factors, and for a PEFT adapter's head (safetensors files named by
SHA-256).

A blob holds each module's canonical factors (`<module>.U`, `.S`, `.V`) and, where the update has its factors' full
rank, the gauge of the file's factors in them (`<module>.M` = Uᵀ·B and `.N` = A·V, r×r each: the factors as the file
had them, B = U·M and A = N·Vᵀ), which the detection of PEFT's factorwise merges reads (zoo/domain/factorwise.py).

Ingest writes an adapter's factors in one pass (`stage_factors`): straight from the tensors' memory to a
temporary file in the store, hashed as they are written, with the bytes `safetensors.numpy.save` would give
(so a digest does not depend on which writer made the blob), and made durable there. It does so on a thread
of its own (`BlobWriter`) while the adapter is described and its rows are written: the transaction waits for
the digest before inserting the adapter's row and for the fsync before renaming the file to its digest
(`commit`) and committing; a duplicate's file is removed (`discard`). A head (zoo/services/file_parts.py: tensors of
any dtype, a few MB at most) is staged the same way, whole, on the ingest's own thread (`stage_tensors`).

`BlobStore` is the interface every caller uses and its default backend, a local directory; `S3BlobStore`
(zoo/store/s3_blobs.py) keeps the same interface in S3-compatible object storage, and `open_blob_store`
(zoo/store/blob_backends.py) opens the one a node's settings name.
"""

from __future__ import annotations

import gc
import hashlib
import io
import json
import math
import mmap
import os
import struct
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from zoo.files import TMP_PREFIX

if TYPE_CHECKING:
    import torch

    from zoo.domain.canonical import CanonicalFactors

#: the safetensors dtype of each numpy dtype a blob may hold
_DTYPES: dict[np.dtype, str] = {np.dtype(np.float32): "F32", np.dtype(np.float64): "F64", np.dtype(np.float16): "F16"}
#: blobs of at least this many bytes are read through a memory map (BlobStore.get; the two cost the same near 1 MiB)
MAPPED_FROM = 1 << 20
#: bytes written between hints to the kernel to start writing them back (so that the final fsync waits for less)
_WRITEBACK_CHUNK = 8 << 20


@dataclass(frozen=True)
class StagedBlob:
    """A blob written whole and fsynced to a temporary file in the store (`tmp`), not yet under its digest; or, in a
    store with no temporary files (an object store), uploaded under its digest already (`tmp` None)."""

    digest: str
    tmp: Path | None
    size: int


@dataclass(frozen=True)
class Leftovers:
    """What a crash can leave in a blob store, as `zoo check` reports it: `orphans`, blobs no row refers to, and
    `temporary`, writes never finished (a local store's temporary files, an object store's multipart uploads), each
    named as `BlobStore.remove` takes it; `in_flight` counts those younger than the grace period (kept)."""

    orphans: list[str]
    temporary: list[str]
    in_flight: int


def safetensors_layout(arrays: dict[str, np.ndarray]) -> tuple[bytes, list[np.ndarray]]:
    """(the 8-byte length and JSON header, the arrays in the order their bytes follow it) of a safetensors file of
    `arrays`, as safetensors writes it: tensors sorted by name (all of one dtype), compact JSON, the header padded
    with spaces to a multiple of 8 bytes."""
    header: dict[str, dict[str, object]] = {}
    ordered: list[np.ndarray] = []
    offset = 0
    for key in sorted(arrays):
        a = np.ascontiguousarray(arrays[key])
        if a.dtype not in _DTYPES or (ordered and a.dtype != ordered[0].dtype):
            raise ValueError(f"blob tensors must share one float dtype, {key} is {a.dtype}")
        header[key] = {"dtype": _DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        ordered.append(a)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, ordered


def factor_arrays(modules: Sequence[tuple[str, CanonicalFactors]]) -> dict[str, np.ndarray]:
    """The blob's tensors: canonical factors, `<module>.U`, `.S` and `.V`, and their gauge where it is known, `.M` and
    `.N`, as numpy views (no copy of contiguous factors)."""
    out: dict[str, np.ndarray] = {}
    for name, f in modules:
        parts = [("U", f.U), ("S", f.S), ("V", f.V), *((("M", f.gauge[0]), ("N", f.gauge[1])) if f.gauge is not None else ())]
        for part, t in parts:
            out[f"{name}.{part}"] = t.detach().cpu().to(f.U.dtype).contiguous().numpy()
    return out


class BlobStore:
    """Blobs by digest, in a local directory: `<root>/<digest[:2]>/<digest>.safetensors`."""

    #: blobs one ingest writes at once, and so sources in flight (zoo.services.ingest.ingest_sources): one written and
    #: fsynced while the next adapter is worked on (writing one takes less time than that work)
    writes_at_once = 2

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def __str__(self) -> str:
        return str(self.root)

    @staticmethod
    def key(digest: str) -> str:
        """A blob's name relative to the store's root (a directory, a bucket's prefix): the same in every backend."""
        return f"{digest[:2]}/{digest}.safetensors"

    def path(self, digest: str) -> Path:
        return self.root / self.key(digest)

    def local_files(self, digests: Sequence[str]) -> list[Path]:
        """The files of these blobs on this machine's disk, for reading them into the page cache ahead of their use
        (zoo/store/read_ahead.py): every one's here; none in an object store, whose reads copy a blob whole."""
        return [self.path(d) for d in digests]

    def where(self, digest: str) -> str:
        """Where a blob is kept, for messages."""
        return str(self.path(digest))

    def verify(self, digest: str) -> str:
        """Whether the blob's bytes hash to its digest: "ok", else "missing" or "corrupt"."""
        path = self.path(digest)
        if not path.is_file():
            return "missing"
        h = hashlib.sha256()
        with path.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        return "ok" if h.hexdigest() == digest else "corrupt"

    def leftovers(self, referenced: set[str], now: float, grace_s: float) -> Leftovers:
        """Blob files whose digest is not in `referenced` and temporary files (a killed writer's), by path; those written
        within `grace_s` seconds of `now` are counted as in flight (a transaction still open may commit them)."""
        orphans: list[str] = []
        temporary: list[str] = []
        in_flight = 0
        files = (p for p in self.root.rglob("*") if p.is_file() and not p.is_symlink()) if self.root.is_dir() else iter(())
        for path in sorted(files):
            stray = path.name.startswith(TMP_PREFIX)
            if not stray and (path.suffix != ".safetensors" or path.stem in referenced):
                continue
            try:
                young = now - path.stat().st_mtime < grace_s
            except FileNotFoundError:  # committed or removed meanwhile
                continue
            if young:
                in_flight += 1
            else:
                (temporary if stray else orphans).append(str(path))
        return Leftovers(orphans, temporary, in_flight)

    def remove(self, names: Sequence[str]) -> int:
        """Remove leftovers named as `leftovers` names them; returns how many."""
        for name in names:
            Path(name).unlink(missing_ok=True)
        return len(names)

    def stage_factors(self, modules: Sequence[tuple[str, CanonicalFactors]]) -> StagedBlob:
        """Write the factors' blob to a temporary file in the store in one pass from their memory, hashing the bytes
        as they go out, and fsync it; `commit` puts it under its digest, `discard` removes it."""
        return self.stage_arrays(factor_arrays(modules))

    def stage_arrays(
        self, arrays: dict[str, np.ndarray], hashed: Callable[[str], None] | None = None, stop: threading.Event | None = None
    ) -> StagedBlob:
        """stage_factors of the blob's arrays (see factor_arrays); `hashed(digest)` is called once every byte is
        hashed and written, before the fsync; once `stop` is set, the writing stops (raising StagingStopped) and
        its file is removed."""
        head, ordered = safetensors_layout(arrays)
        self.root.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=self.root, prefix=TMP_PREFIX, suffix=".safetensors")
        tmp, h = Path(name), hashlib.sha256(head)
        try:
            with os.fdopen(fd, "wb", buffering=0) as fh:
                _write_all(fh, memoryview(head))
                size = started = len(head)
                for a in ordered:
                    if stop is not None and stop.is_set():
                        raise StagingStopped
                    view = a.reshape(-1).view(np.uint8).data  # bytes of the array's memory, no copy
                    h.update(view)
                    _write_all(fh, view)
                    size += a.nbytes
                    if size - started >= _WRITEBACK_CHUNK:
                        _start_writeback(fh.fileno(), started, size - started)
                        started = size
                digest = h.hexdigest()
                if hashed is not None:
                    hashed(digest)
                if stop is not None and stop.is_set():
                    raise StagingStopped
                os.fsync(fh.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return StagedBlob(digest, tmp, size)

    def stage_tensors(self, tensors: dict[str, torch.Tensor]) -> StagedBlob:
        """A blob of any tensors (a head: any dtypes), the bytes safetensors.torch.save gives, written whole to a temporary
        file in the store and fsynced; `commit` puts it under its digest, `discard` removes it."""
        from safetensors.torch import save

        data = save(tensors)
        self.root.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=self.root, prefix=TMP_PREFIX, suffix=".safetensors")
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb", buffering=0) as fh:
                _write_all(fh, memoryview(data))
                os.fsync(fh.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return StagedBlob(hashlib.sha256(data).hexdigest(), tmp, len(data))

    def commit(self, staged: StagedBlob) -> None:
        """Put a staged blob under its digest (durably: the rename and its directory are fsynced); when that blob
        is stored already, the staged copy is removed and the stored one's time touched, so that `zoo check --repair`
        does not take it for an old orphan (a deleted adapter's) while the row that now refers to it commits."""
        assert staged.tmp is not None, "a blob staged by this store has a temporary file"
        target = self.path(staged.digest)
        try:
            os.utime(target)
        except FileNotFoundError:  # not stored (or removed meanwhile): this copy goes there
            pass
        else:
            staged.tmp.unlink(missing_ok=True)
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged.tmp, target)
        _fsync_dir(target.parent)

    @staticmethod
    def discard(staged: StagedBlob) -> None:
        """Remove a staged blob's temporary file (an object uploaded already stays: an orphan for `zoo check --repair`
        unless a row refers to it, since another writer's row may)."""
        if staged.tmp is not None:
            staged.tmp.unlink(missing_ok=True)

    def get(self, digest: str) -> dict[str, torch.Tensor]:
        """A blob's tensors. A large one is read through a memory map: a blob of canonical factors (one dtype) as views
        of a private map of the file, no copy at all (`mapped_tensors`); any other one copied out of the map once by
        safetensors. One under MAPPED_FROM bytes is read whole, which costs less than setting up the map (the relation
        step reads a few dozen blobs an adapter; a 16 KB blob: 0.08 ms against 0.20)."""
        from safetensors.torch import load, load_file

        path = self.path(digest)
        with path.open("rb") as f, collections_paused():
            size = os.fstat(f.fileno()).st_size
            if size < MAPPED_FROM:
                return load(f.read())
            tensors = mapped_tensors(f, size)
        return tensors if tensors is not None else load_file(path)

    def get_factors_of(self, digests: Sequence[str]) -> list[list[tuple[str, CanonicalFactors]]]:
        """get_factors of each digest, in order (an object store reads several at once)."""
        return [self.get_factors(d) for d in digests]

    def get_factors(self, digest: str) -> list[tuple[str, CanonicalFactors]]:
        """The canonical factors by module, with their gauge where the blob has it (none in blobs written before)."""
        from zoo.domain.canonical import CanonicalFactors

        with collections_paused():
            tensors = self.get(digest)
            names = sorted({k[: -len(".U")] for k in tensors if k.endswith(".U")})
            return [(n, CanonicalFactors(tensors[f"{n}.U"], tensors[f"{n}.S"], tensors[f"{n}.V"], _gauge(tensors, n))) for n in names]


@contextmanager
def collections_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the block, as it was after. A blob's header and tensors are tens of
    thousands of new objects, none in a cycle (a Llama-3-8B blob: 1,120 entries, about 70,000 objects), and the
    collections their allocations set off took half of its read in a process holding torch and the store (9-14 ms
    against 4-6 ms)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def mapped_tensors(f: io.BufferedReader, size: int) -> dict[str, torch.Tensor] | None:
    """The tensors of a safetensors file of one dtype of `_DTYPES` (a blob of canonical factors) as views of one private
    (copy-on-write) memory map of it: the pages come from the page cache as they are touched, and nothing is copied
    (safetensors' `load_file` copies every tensor out of its map, a few µs each: an SDXL adapter's blob holds 2,090,
    and its 50 MB took 100 ms against 15 here). A blob is never written in place (content-addressed, renamed into
    place), so the map always holds its bytes; writing to a tensor touches a private copy of the page only. None
    when the file is not such a file or its header does not describe it exactly (another dtype, mixed dtypes, gaps,
    a truncated file): then safetensors reads it, and raises what it finds."""
    import torch

    first = f.read(8)
    if len(first) < 8:
        return None
    n = struct.unpack("<Q", first)[0]
    if n > size - 8:
        return None
    try:
        header = json.loads(f.read(n))
    except ValueError:
        return None
    entries = sorted(((v["data_offsets"], k, v) for k, v in header.items() if k != "__metadata__"), key=lambda e: e[0][0])
    dtypes = {v.get("dtype") for _, _, v in entries}
    dtype = next((d for d, name in _DTYPES.items() if {name} == dtypes), None)
    start = 8 + n
    if dtype is None or start % dtype.itemsize:
        return None
    end = 0
    for (a, b), _, v in entries:  # contiguous, in order, each its shape's bytes
        if a != end or b - a != math.prod(v["shape"]) * dtype.itemsize:
            return None
        end = b
    if start + end != size:
        return None
    flat = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), dtype=dtype, offset=start)
    step = dtype.itemsize
    return {k: torch.from_numpy(flat[a // step : b // step].reshape(v["shape"])) for (a, b), k, v in entries}


def _gauge(tensors: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    return (tensors[f"{name}.M"], tensors[f"{name}.N"]) if f"{name}.M" in tensors else None


class StagingStopped(Exception):
    """A blob's writing was stopped before it was durable (its writer was discarded)."""


class BlobWriter:
    """A factors' blob staged (BlobStore.stage_factors) by a thread of its own while the caller goes on: `digest()`
    waits until its bytes are hashed, `staged()` until they are durable (raising what the writing raised),
    `discard()` stops the writing if it is not done (a duplicate's blob is not fsynced), waits for the thread and
    removes the staged file unless it was committed."""

    def __init__(self, store: BlobStore, modules: Sequence[tuple[str, CanonicalFactors]]) -> None:
        arrays = factor_arrays(modules)  # numpy views, taken here: the thread touches no torch tensor
        self._digest: Future[str] = Future()
        self._staged: Future[StagedBlob] = Future()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(store, arrays), name="zoo-blob-writer", daemon=True)
        self._thread.start()

    def _run(self, store: BlobStore, arrays: dict[str, np.ndarray]) -> None:
        try:
            self._staged.set_result(store.stage_arrays(arrays, hashed=self._digest.set_result, stop=self._stop))
        except Exception as exc:  # noqa: BLE001 - handed to the caller, who reports it
            if not self._digest.done():
                self._digest.set_exception(exc)
            self._staged.set_exception(exc)

    def digest(self) -> str:
        return self._digest.result()

    def staged(self) -> StagedBlob:
        return self._staged.result()

    def discard(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._staged.exception() is None:
            BlobStore.discard(self._staged.result())


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing back a range just written (Linux starts writeback of dirty pages on
    POSIX_FADV_DONTNEED and drops only pages already clean, which these are not yet), so that the disk works while
    the rest is hashed and the final fsync has less left to wait for (0.16 s instead of 0.26-0.37 s for 168 MB here)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _write_all(fh: io.FileIO, view: memoryview) -> None:
    """Write every byte of `view` to an unbuffered file (a raw write may write fewer)."""
    while view:
        n = fh.write(view)
        view = view[n:]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
