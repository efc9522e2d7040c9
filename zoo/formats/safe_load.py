"""Loading tensors from untrusted files: safetensors with header checks, weights-only pickles.

A weight file is read once (`read_weight_file`): its bytes are hashed as they are read, and the
tensors are then built from those same bytes, so ingest never opens a file twice.

A safetensors file of at least `stream_min_bytes()` (a full checkpoint) is not held: it is hashed as
it is read, keeping only its header (`StreamedFile`), and its tensors are then read one at a time
(`StreamedTensors`), each checked against the file as it was hashed: read in the file's order, the
bytes the tensors were built from are hashed again and must give the same SHA-256 (`verify`).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from zoo import config
from zoo.errors import InputError

#: bytes per element of each safetensors dtype
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}  # fmt: skip
#: the torch dtype of each safetensors dtype
TORCH_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E5M2": torch.float8_e5m2,
                "F8_E4M3": torch.float8_e4m3fn, "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16,
                "BF16": torch.bfloat16, "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
                "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64}  # fmt: skip
SAFETENSORS_SUFFIX = ".safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
#: bytes read (and hashed) per call
_CHUNK = 1 << 22


def max_header_bytes() -> int:
    """Largest safetensors JSON header accepted (ZOO_MAX_HEADER_BYTES, default 16 MiB)."""
    return config.MAX_HEADER_BYTES.get()


def max_file_bytes() -> int:
    """Largest weight file accepted (ZOO_MAX_FILE_BYTES, default 4 GiB), as for uploads."""
    return config.MAX_FILE_BYTES.get()


def stream_min_bytes() -> int:
    """Safetensors files at least this large are streamed, not held (ZOO_STREAM_MIN_BYTES, default 256 MiB)."""
    return config.STREAM_MIN_BYTES.get()


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is written, truncated or replaced (a write updates ctime, which no one can set)."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


@dataclass(frozen=True)
class StreamedFile:
    """A file too large to hold, read once to hash it: its size, its first bytes (the safetensors header) and its
    identity when hashed. Sliced (within `head`) and sized like the bytes it stands for."""

    path: Path
    size: int
    head: bytes
    identity: tuple[int, ...]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: slice) -> bytes:
        start, stop, _ = index.indices(self.size)
        if stop > len(self.head):
            raise InputError(self.path, f"bytes {start}:{stop} were not kept when the file was read")
        return self.head[start:stop]


@dataclass(frozen=True)
class WeightFile:
    """A weight file's bytes, read once (or, for a large safetensors file, streamed: see StreamedFile), and their SHA-256."""

    path: Path
    data: bytearray | StreamedFile
    sha256: str

    @property
    def size(self) -> int:
        return len(self.data)


def check_file_size(path: Path, size: int) -> None:
    if size > max_file_bytes():
        raise InputError(path, f"file of {size} bytes exceeds the limit of {max_file_bytes()} bytes (ZOO_MAX_FILE_BYTES)")


def read_weight_file(path: Path) -> WeightFile:
    """The bytes of a .safetensors or weights-only pickle file and their SHA-256, hashed while they are read;
    a file over max_file_bytes() is refused before it is read, one that changes while read after. A safetensors
    file of stream_min_bytes() or more is hashed without being held (see StreamedFile)."""
    if path.suffix != SAFETENSORS_SUFFIX and path.suffix not in PICKLE_SUFFIXES:
        raise InputError(path, "unsupported file type: expected .safetensors (or a weights-only .bin/.pt/.pth)")
    h = hashlib.sha256()
    try:
        with path.open("rb") as fh:
            st = os.fstat(fh.fileno())
            size = st.st_size
            check_file_size(path, size)
            if path.suffix == SAFETENSORS_SUFFIX and size >= stream_min_bytes():
                return _hash_streamed(path, fh, st, h)
            data = bytearray(size)
            with memoryview(data) as view:
                done = 0
                while done < size and (n := fh.readinto(view[done : done + _CHUNK])):
                    h.update(view[done : done + n])
                    done += n
            if done < size:
                raise InputError(path, f"the file changed while it was read (it had {size} bytes, then {done})")
            if fh.read(1):
                raise InputError(path, f"the file changed while it was read (it grew past {size} bytes)")
    except FileNotFoundError:
        raise InputError(path, "no such file") from None
    except OSError as exc:
        raise InputError(path, f"unreadable ({exc.strerror or type(exc).__name__})") from None
    return WeightFile(path, data, h.hexdigest())


def _hash_streamed(path: Path, fh: io.BufferedReader, st: os.stat_result, h: hashlib._Hash) -> WeightFile:
    """Hash an open safetensors file chunk by chunk, keeping only its header's bytes (when the header is within
    max_header_bytes(); safetensors_header refuses it otherwise)."""
    head = fh.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
    if n <= max_header_bytes():
        head += fh.read(n)
    h.update(head)
    done = len(head)
    buf = bytearray(_CHUNK)
    with memoryview(buf) as view:
        while n := fh.readinto(view):
            h.update(view[:n])
            done += n
    if done != st.st_size or _identity(os.fstat(fh.fileno())) != _identity(st):
        raise InputError(path, f"the file changed while it was read (it had {st.st_size} bytes, then {done})")
    return WeightFile(path, StreamedFile(path, st.st_size, bytes(head), _identity(st)), h.hexdigest())


def read_safetensors_stream(path: Path, fh: IO[bytes], size: int) -> WeightFile:
    """A safetensors file of `size` bytes from a stream that may expand (a zip member): its header read and checked
    first (framing, and every tensor within ZOO_MAX_MODULE_WIDTH), and only then the rest read into one buffer of
    `size` bytes and hashed; a stream that ends early or runs past `size` is refused."""
    from zoo.formats.limits import check_widths

    head = fh.read(8)
    n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
    if n <= max_header_bytes() and 8 + n <= size:
        head += fh.read(n)
    header = safetensors_header(path, StreamedFile(path, size, head, ()))
    check_widths(path, [(key, info["shape"]) for key, info in header.entries.items()])
    data = bytearray(size)
    data[: len(head)] = head
    done = len(head)
    while done < size and (chunk := fh.read(min(_CHUNK, size - done))):
        data[done : done + len(chunk)] = chunk
        done += len(chunk)
    if done < size or fh.read(1):
        raise InputError(path, f"the stream did not hold the {size} bytes it declared")
    return WeightFile(path, data, hashlib.sha256(data).hexdigest())


def open_streamed(path: Path) -> StreamedTensors:
    """The tensors of a safetensors file read one at a time under its checked header, without hashing the file
    (for a base checkpoint, whose bytes are not recorded)."""
    try:
        with path.open("rb") as fh:
            st = os.fstat(fh.fileno())
            check_file_size(path, st.st_size)
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            if n <= max_header_bytes():
                head += fh.read(n)
    except FileNotFoundError:
        raise InputError(path, "no such file") from None
    except OSError as exc:
        raise InputError(path, f"unreadable ({exc.strerror or type(exc).__name__})") from None
    source = StreamedFile(path, st.st_size, head, _identity(st))
    return StreamedTensors(WeightFile(path, source, ""), safetensors_header(path, source))


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


@dataclass(frozen=True)
class SafetensorsHeader:
    """A checked safetensors header: tensor entries by name, `__metadata__`, where the tensor data starts."""

    entries: dict[str, dict]
    metadata: dict[str, str]
    data_start: int


def _header_length(path: Path, data: bytes | bytearray | StreamedFile) -> int:
    """The header length the file's first 8 bytes give, once it is one a safetensors file can have: within the
    file, starting with '{' (as the format requires). Other bytes (random ones, another format) are "not a
    safetensors file", not a header over the limit; a plausible header over ZOO_MAX_HEADER_BYTES is that."""
    size = len(data)
    if size < 8:
        raise InputError(path, f"truncated safetensors file ({size} bytes, no header length)")
    (n,) = struct.unpack("<Q", bytes(data[0:8]))
    if 8 + n > size:
        if n > max_header_bytes():
            raise InputError(path, f"not a safetensors file: its first 8 bytes give a header length of {n}, more than its {size} bytes")
        raise InputError(path, f"truncated safetensors file: header claims {n} bytes but the file has {size}")
    if n > max_header_bytes():
        raise InputError(path, f"safetensors header of {n} bytes exceeds the limit of {max_header_bytes()} bytes")
    if n == 0:
        raise InputError(path, "not a safetensors file: its first 8 bytes give a header length of 0 (no JSON header)")
    if (first := bytes(data[8:9])) != b"{":
        raise InputError(path, f"not a safetensors file: its {n}-byte header is not JSON (it starts with byte 0x{first.hex()}, not '{{')")
    return n


def json_problem(exc: Exception) -> str:
    """Why bytes are not JSON Python reads: the exception's name, or an integer past Python's 4,300 digits (json raises a
    bare ValueError for one: `sys.get_int_max_str_digits`)."""
    return type(exc).__name__ if type(exc) is not ValueError else "an integer of more than 4,300 digits"


def safetensors_header(path: Path, data: bytes | bytearray | StreamedFile) -> SafetensorsHeader:
    """Check the framing of a safetensors file's bytes and every tensor entry of its header (dtype, shape,
    offsets that match the shape, inside the file, not overlapping and, as the format requires, packed
    from the start of the data to its end)."""
    size = len(data)
    n = _header_length(path, data)
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: not JSON, or an integer Python will not read
        raise InputError(path, f"corrupt safetensors header (not JSON: {json_problem(exc)})") from None
    if not isinstance(header, dict):
        raise InputError(path, "corrupt safetensors header (not a JSON object)")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise InputError(path, "corrupt safetensors header: __metadata__ must map names to strings")
    data_size = size - 8 - n
    spans: list[tuple[int, int]] = []
    for key, info in header.items():
        if not isinstance(info, dict):
            raise InputError(path, f"corrupt safetensors header: tensor {key!r} is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise InputError(path, f"corrupt safetensors header: tensor {key!r} has unknown dtype {str(dtype)[:20]!r}")
        if not (isinstance(shape, list) and len(shape) <= 8 and all(_is_int(d) for d in shape)):
            raise InputError(path, f"corrupt safetensors header: tensor {key!r} has no valid shape")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets) and offsets[0] <= offsets[1]):
            raise InputError(path, f"corrupt safetensors header: tensor {key!r} has no valid data_offsets")
        numel = math.prod(shape)
        if offsets[1] > data_size:
            raise InputError(path, f"truncated safetensors file: tensor {key!r} needs {offsets[1]} data bytes, the file has {data_size}")
        if numel * DTYPE_BYTES[dtype] != offsets[1] - offsets[0]:
            span = offsets[1] - offsets[0]
            raise InputError(path, f"corrupt safetensors header: tensor {key!r} of shape {shape} does not fill its {span} bytes")
        spans.append((offsets[0], offsets[1]))
    spans.sort()
    end = 0
    for start, stop in spans:
        if start < end:
            raise InputError(path, "corrupt safetensors header: tensors overlap")
        if start > end:
            raise InputError(path, f"corrupt safetensors file: {start - end} data bytes at offset {end} belong to no tensor")
        end = stop
    if end != data_size:
        raise InputError(path, f"corrupt safetensors file: {data_size - end} data bytes after the last tensor belong to no tensor")
    return SafetensorsHeader(header, {str(k): v for k, v in (meta or {}).items()}, 8 + n)


def safetensors_tensors(wf: WeightFile, header: SafetensorsHeader) -> Mapping[str, torch.Tensor]:
    """The tensors of a safetensors file's bytes under its checked header: views of the bytes (no copy),
    except those whose offset is not a multiple of their element size, which are copied; for a streamed file,
    a mapping that reads each tensor when it is looked up (see StreamedTensors). A tensor wider than
    ZOO_MAX_MODULE_WIDTH is refused from the header, before any is read (zoo/formats/limits.py)."""
    from zoo.formats.limits import check_widths

    check_widths(wf.path, [(key, info["shape"]) for key, info in header.entries.items()])
    if isinstance(wf.data, StreamedFile):
        return StreamedTensors(wf, header)
    tensors: dict[str, torch.Tensor] = {}
    for key, info in header.entries.items():
        dtype, shape, (begin, end) = TORCH_DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
        if begin == end:
            tensors[key] = torch.empty(shape, dtype=dtype)
            continue
        offset = header.data_start + begin
        t = torch.frombuffer(wf.data, dtype=dtype, count=math.prod(shape), offset=offset).reshape(shape)
        tensors[key] = t if offset % DTYPE_BYTES[info["dtype"]] == 0 else t.clone()
    return tensors


class StreamedTensors(Mapping[str, torch.Tensor]):
    """The tensors of a streamed safetensors file (under its checked header), each read from the file when it is
    looked up and not kept; iteration is in the file's order. Every read checks that the file is the one that was
    hashed (same identity); reads in the file's order also hash the bytes the tensors are built from, and once the
    last byte is read that hash must be the file's SHA-256. `verify()` completes that check whatever was read."""

    def __init__(self, wf: WeightFile, header: SafetensorsHeader) -> None:
        assert isinstance(wf.data, StreamedFile)
        self.path, self.source, self.header, self.sha256 = wf.path, wf.data, header, wf.sha256
        self._order = sorted(header.entries, key=lambda k: header.entries[k]["data_offsets"][0])
        self._data_size = self.source.size - header.data_start
        self._hash = hashlib.sha256(self.source.head[: header.data_start])
        self._hashed = 0  # data bytes hashed so far, in order from the start
        self.verified = not self.sha256  # nothing to check against when the file was not hashed

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self.header.entries

    def shape(self, key: str) -> list[int]:
        return list(self.header.entries[key]["shape"])

    def dtype(self, key: str) -> torch.dtype:
        return TORCH_DTYPES[self.header.entries[key]["dtype"]]

    def __getitem__(self, key: str) -> torch.Tensor:
        info = self.header.entries[key]
        begin, end = info["data_offsets"]
        dtype, shape = TORCH_DTYPES[info["dtype"]], info["shape"]
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        buf = self._read(self.header.data_start + begin, end - begin)
        if begin == self._hashed:
            self._account(buf)
        return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).reshape(shape)

    def verify(self) -> None:
        """Hash the data bytes not yet hashed in order and compare with the file's SHA-256."""
        while not self.verified:
            n = min(_CHUNK, self._data_size - self._hashed)
            self._account(self._read(self.header.data_start + self._hashed, n) if n else bytearray())

    def _account(self, buf: bytearray) -> None:
        self._hash.update(buf)
        self._hashed += len(buf)
        if self._hashed == self._data_size and self.sha256:
            if self._hash.hexdigest() != self.sha256:
                raise InputError(self.path, "the file changed while it was read (its bytes no longer have the SHA-256 first read)")
            self.verified = True

    def _read(self, offset: int, n: int) -> bytearray:
        buf = bytearray(n)
        try:
            with self.path.open("rb") as fh:
                same = _identity(os.fstat(fh.fileno())) == self.source.identity
                fh.seek(offset)
                got = fh.readinto(buf) if same else 0
        except OSError as exc:
            raise InputError(self.path, f"unreadable ({exc.strerror or type(exc).__name__})") from None
        if not same or got != n:
            raise InputError(self.path, "the file changed while it was read (it is no longer the file whose header was checked)")
        return buf


#: keys under which training checkpoints hold the model's weights: PyTorch Lightning's `state_dict`, a training loop's
#: `model_state_dict`, DeepSpeed's `module`
NESTED_KEYS = ("state_dict", "model_state_dict", "module")
#: prefixes every weight's name gets from a wrapper: DistributedDataParallel's and DeepSpeed's `module.`, and a
#: flattened training checkpoint's `state_dict.` / `model_state_dict.`
WRAPPER_PREFIXES = ("module.", "state_dict.", "model_state_dict.")


def wrapper_prefix(keys: list[str]) -> str:
    """The run of WRAPPER_PREFIXES that every one of `keys` starts with (`module.`, `state_dict.module.`, ...), else ""."""
    prefix = ""
    while keys:
        step = next((p for p in WRAPPER_PREFIXES if all(k.startswith(prefix + p) for k in keys)), None)
        if step is None:
            return prefix
        prefix += step
    return prefix


def _is_state_dict(obj: object) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def inner_state_dict(path: Path, obj: object) -> dict[str, torch.Tensor]:
    """The tensors of a loaded pickle: a dict of tensors as it is, else the dict of tensors a training checkpoint
    nests under one of NESTED_KEYS (at any depth of such keys; its other entries, optimizer states, epoch, are left
    out), with the `wrapper_prefix` that every name has dropped."""
    seen: list[str] = []
    while isinstance(obj, dict) and not _is_state_dict(obj):
        key = next((k for k in NESTED_KEYS if isinstance(obj.get(k), dict)), None)
        if key is None:
            where = f" under {'/'.join(seen)}" if seen else ""
            nested = ", ".join(NESTED_KEYS)
            raise InputError(path, f"refused: expected a dict of tensors{where} (or a training checkpoint with one under {nested})")
        seen.append(key)
        obj = obj[key]
    if not _is_state_dict(obj):
        raise InputError(path, "refused: expected a dict of tensors")
    assert isinstance(obj, dict)
    prefix = wrapper_prefix(list(obj))
    return {k.removeprefix(prefix): v for k, v in obj.items()} if prefix else obj


def parse_weights_only_pickle(wf: WeightFile) -> dict[str, torch.Tensor]:
    """A torch pickle's bytes loaded with weights_only=True (code in the pickle is never run), as `inner_state_dict`."""
    assert isinstance(wf.data, bytearray)  # only a safetensors file is streamed
    try:
        obj = torch.load(io.BytesIO(wf.data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever a hostile pickle makes torch raise, the file is refused
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(wf.path, f"refused: not a weights-only torch file ({first})") from None
    return inner_state_dict(wf.path, obj)


def parse_tensors(wf: WeightFile) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors (and metadata) of a read .safetensors file or weights-only .bin/.pt/.pth pickle (a streamed file's
    all read, in its order, and verified)."""
    if wf.path.suffix == SAFETENSORS_SUFFIX:
        header = safetensors_header(wf.path, wf.data)
        tensors = safetensors_tensors(wf, header)
        held = dict(tensors)
        if isinstance(tensors, StreamedTensors):
            tensors.verify()
        return held, header.metadata
    return parse_weights_only_pickle(wf), {}


def load_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors (and metadata) of a .safetensors file or a weights-only .bin/.pt/.pth pickle."""
    return parse_tensors(read_weight_file(path))
