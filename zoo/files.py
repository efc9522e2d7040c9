"""Files that are replaced whole: a reader (or a process after a crash) sees the old file or the new one; and the
derived files (indexes, module stores, maps), rebuilt from the database whenever one is missing or damaged."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

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


def derived_checksum(tensors: Mapping[str, np.ndarray], meta: Mapping[str, object]) -> str:
    """SHA-256 of the metadata (as sorted JSON) and of every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        h.update(f"{name}:{tensors[name].dtype}:{tensors[name].shape}".encode())
        h.update(np.ascontiguousarray(tensors[name]).data)
    return h.hexdigest()
