"""Files that are replaced whole: a reader (or a process after a crash) sees the old file or the new one; and the
derived files (indexes, module stores, maps), rebuilt from the database whenever one is missing or damaged."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
import struct
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

#: temporary files of unfinished writes start with this (`zoo check` finds those a crash left)
TMP_PREFIX = ".tmp-"


def replace_durably(target: Path, write: Callable[[Path], None]) -> None:
    """`write` a temporary file beside `target`, fsync it, rename it over `target` and fsync the
    directory, so that the rename itself survives a crash. A failed write leaves no temporary file."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=TMP_PREFIX, suffix=target.suffix)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with tmp.open("rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


#: the key of a derived file's safetensors metadata that holds its JSON metadata (with the checksum)
DERIVED_META_KEY = "zoo"


def write_derived(path: Path, tensors: Mapping[str, np.ndarray], meta: Mapping[str, object]) -> None:
    """Write a derived file durably: the tensors, and under DERIVED_META_KEY the JSON metadata (its `version` is
    the space version it covers) with a checksum over both, which `read_derived` verifies."""
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    full = {**meta, "checksum": derived_checksum(arrays, meta)}
    replace_durably(path, lambda tmp: save_file(arrays, str(tmp), metadata={DERIVED_META_KEY: json.dumps(full)}))


#: safetensors' names of the dtypes `write_derived_in_place` writes
_SAFETENSORS_DTYPES = {np.dtype(t): n for t, n in ((np.float32, "F32"), (np.float64, "F64"), (np.float16, "F16"), (np.int64, "I64"))}
#: bytes read at a time to checksum a file written in place
_CHECKSUM_READ = 64 << 20

#: fills a file's tensors in place: (the tensors, mapped onto the file; release: called after each part written)
Filler = Callable[[dict[str, np.ndarray], Callable[[], None]], None]


def write_derived_in_place(path: Path, shapes: Mapping[str, tuple[int, ...]], meta: Mapping[str, object], fill: Filler) -> None:
    """Write a derived file as `write_derived` does, its float32 tensors (of these shapes; "ids" int64) filled in the
    file itself: `fill(tensors, release)` gets them as writable arrays mapped onto the file, zeros at first, and calls
    `release()` after each part it wrote, which writes the part's pages out and drops them from the process's memory.
    So a file larger than the memory a caller may take (a module store: up to ZOO_MODULE_STORE_BYTES) is written
    holding one part; the checksum is then read back from the file a piece at a time."""
    dtypes = {n: np.dtype(np.int64 if n == "ids" else np.float32) for n in shapes}
    offsets, end = {}, 0
    for name in sorted(shapes):
        size = dtypes[name].itemsize * math.prod(shapes[name])
        offsets[name], end = (end, end + size), end + size

    def header(checksum: str) -> bytes:
        entries = {
            n: {"dtype": _SAFETENSORS_DTYPES[dtypes[n]], "shape": list(shapes[n]), "data_offsets": list(offsets[n])} for n in offsets
        }
        raw = json.dumps({"__metadata__": {DERIVED_META_KEY: json.dumps({**meta, "checksum": checksum})}, **entries}).encode()
        return raw + b" " * (-len(raw) % 8)  # safetensors' writer aligns the data to 8 bytes

    def write(tmp: Path) -> None:
        start = 8 + len(header("0" * 64))  # a checksum is 64 hex digits: the header's length is known before it
        with tmp.open("r+b") as fh:
            fh.truncate(start + end)
            mapped = mmap.mmap(fh.fileno(), start + end)
            try:

                def release() -> None:
                    mapped.flush()
                    mapped.madvise(mmap.MADV_DONTNEED)

                views = {
                    n: np.frombuffer(mapped, dtypes[n], math.prod(shapes[n]), start + b).reshape(shapes[n]) for n, (b, _) in offsets.items()
                }
                fill(views, release)
                release()
                del views  # the map closes only once no array views it
            finally:
                # a fill that raised left arrays viewing the map in its traceback's frames: closing it then would raise
                # BufferError in place of the fill's error; the map goes with the last of them instead
                with contextlib.suppress(BufferError):
                    mapped.close()
            digest = _checksum(meta, ((n, dtypes[n], tuple(shapes[n]), _read(fh, start + b, start + e)) for n, (b, e) in offsets.items()))
            fh.seek(0)
            fh.write(struct.pack("<Q", start - 8) + header(digest))

    replace_durably(path, write)


def _read(fh: BinaryIO, begin: int, end: int) -> Iterator[memoryview]:
    """The file's bytes begin..end in pieces, as views of a read-only map of it, each piece's pages let go once the
    caller is done with it: read() into a new buffer a piece took twice the CPU (1.3 against 0.66 s a GB, most of it
    the new buffers' page faults and the copy)."""
    if end <= begin:
        return
    with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
        while begin < end:
            stop = min(begin + _CHECKSUM_READ, end)
            with view[begin:stop] as piece:
                yield piece
            first = begin - begin % mmap.PAGESIZE
            mapped.madvise(mmap.MADV_DONTNEED, first, stop - first)
            begin = stop


#: reads a file written before the derived-file format: (tensors, the file's safetensors metadata) -> its metadata when
#: it verifies in its old layout, else None
LegacyReader = Callable[[dict[str, np.ndarray], dict[str, str]], "dict | None"]


def read_derived(path: Path, what: str, legacy: LegacyReader | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """(tensors, metadata) of a derived file written by `write_derived` (or, by `legacy`, in its kind's older layout);
    ValueError naming `what` (e.g. "index") when the file is missing, unreadable or disagrees with its checksum (the
    caller rebuilds it from the database)."""
    if not Path(path).exists():
        raise ValueError(f"no {what} file {path}")
    try:
        with safe_open(str(path), "np") as fh:
            raw = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 - safe_open has no __iter__
        meta = json.loads(raw[DERIVED_META_KEY]) if DERIVED_META_KEY in raw else None
    except Exception as exc:  # noqa: BLE001 - whatever safetensors or json make of a damaged file, it is unreadable
        raise ValueError(f"{what} file {path} is missing or unreadable ({type(exc).__name__})") from None
    if isinstance(meta, dict) and meta.pop("checksum", None) == derived_checksum(tensors, meta):
        return tensors, meta
    old = legacy(tensors, raw) if legacy is not None else None
    if old is None:
        raise ValueError(f"{what} file {path} disagrees with itself (checksum)")
    return tensors, old


#: numpy's dtype of each safetensors dtype name a derived file may hold
_NUMPY_DTYPES = {
    "U8": np.uint8,
    "I8": np.int8,
    "I32": np.int32,
    "I64": np.int64,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "BOOL": np.bool_,
}


def read_derived_mapped(path: Path, what: str, mapped: Collection[str]) -> tuple[dict[str, np.ndarray], dict]:
    """`read_derived` with the tensors named in `mapped` as read-only arrays mapped onto the file (np.memmap), not read
    into memory: their pages are the page cache's, resident in the process only once touched (counted in its RssFile,
    not RssAnon) and dropped by the kernel under memory pressure, to be read from disk again when next touched. The
    checksum is read from the file a piece at a time, not through the map, so verifying it maps nothing in. ValueError
    naming `what` when the file is missing, unreadable, disagrees with its checksum or is in an older layout (the
    caller falls back on `read_derived`)."""
    if not Path(path).exists():
        raise ValueError(f"no {what} file {path}")
    try:
        with Path(path).open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
            raw = header.pop("__metadata__", None) or {}
            meta = json.loads(raw[DERIVED_META_KEY])
            start = 8 + length
            parts: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {
                name: (np.dtype(_NUMPY_DTYPES[entry["dtype"]]), tuple(int(x) for x in entry["shape"]), *_offsets(entry["data_offsets"]))
                for name, entry in header.items()
            }
            tensors: dict[str, np.ndarray] = {}
            for name, (dtype, shape, begin, end) in parts.items():
                if name in mapped and end > begin:
                    tensors[name] = np.memmap(path, dtype, mode="r", offset=start + begin, shape=shape)
                else:
                    fh.seek(start + begin)
                    tensors[name] = np.frombuffer(bytearray(fh.read(end - begin)), dtype).reshape(shape)
            given = meta.pop("checksum", None) if isinstance(meta, dict) else None
            digest = _checksum(
                meta,
                ((n, dtype, shape, _read(fh, start + b, start + e)) for n, (dtype, shape, b, e) in sorted(parts.items())),
            )
    except Exception as exc:  # noqa: BLE001 - whatever a damaged header or short file raises, it is unreadable
        raise ValueError(f"{what} file {path} is missing or unreadable ({type(exc).__name__})") from None
    if given != digest:
        raise ValueError(f"{what} file {path} disagrees with itself (checksum)")
    return tensors, meta


def _offsets(pair: list) -> tuple[int, int]:
    begin, end = pair
    return int(begin), int(end)


def derived_checksum(tensors: Mapping[str, np.ndarray], meta: Mapping[str, object]) -> str:
    """SHA-256 of the metadata (as sorted JSON) and of every tensor's name, dtype, shape and bytes, in name order."""
    return _checksum(meta, ((n, tensors[n].dtype, tensors[n].shape, [np.ascontiguousarray(tensors[n]).data]) for n in sorted(tensors)))


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in chunks (a checkpoint or an upload is never held whole)."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _checksum(meta: Mapping[str, object], tensors: Iterable[tuple[str, np.dtype, tuple[int, ...], Iterable[bytes | memoryview]]]) -> str:
    """`derived_checksum` of tensors given in name order as (name, dtype, shape, their bytes in pieces)."""
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name, dtype, shape, pieces in tensors:
        h.update(f"{name}:{dtype}:{shape}".encode())
        for piece in pieces:
            h.update(piece)
    return h.hexdigest()
