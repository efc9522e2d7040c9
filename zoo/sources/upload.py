"""Uploaded files (the web app's `file` fields) laid out on disk as one adapter to read.

Accepted: the two files of a PEFT directory (`adapter_config.json` and `adapter_model.safetensors`),
a zip of one PEFT directory, or one LoRA `.safetensors` file. Names are never used as paths: each
file is written under a sanitized name in a fresh directory, and a zip's members are checked (no
absolute or parent paths, no links, at most MAX_ZIP_MEMBERS, the sum of their sizes within the
upload limit) before it is read; it is read into memory, never extracted. Only safetensors weights
are taken: no pickles.
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from zoo.errors import InputError
from zoo.formats.archive import PEFT_WEIGHTS, ZIP_SUFFIX, missing_peft_files, peft_members
from zoo.formats.peft import CONFIG_NAME


class UploadTooLarge(InputError):
    """The upload, or what a zip expands to, is over the limit."""

    http_status = 413
    error_type = "too_large"


@dataclass(frozen=True)
class Upload:
    filename: str
    stream: BinaryIO


def materialize(files: Sequence[Upload], workdir: Path, max_bytes: int) -> Path:
    """Write the uploaded files under `workdir` (which must be empty) and return the path to read as one adapter."""
    if not files:
        raise InputError("upload", "no file: send a `file` field (a PEFT directory's two files, a zip of one, or a .safetensors)")
    names = sorted(PurePosixPath(f.filename.replace("\\", "/")).name for f in files)
    if len(files) == 2 and names == sorted((CONFIG_NAME, PEFT_WEIGHTS)):
        target = workdir / "upload"  # the query's name: two loose files carry no folder name
        target.mkdir()
        for f in files:
            _copy(f, target / PurePosixPath(f.filename.replace("\\", "/")).name, max_bytes)
        return target
    if len(files) == 1 and names[0].lower().endswith(ZIP_SUFFIX):
        archive = workdir / _safe_name(names[0])
        _copy(files[0], archive, max_bytes)
        return _checked_zip(archive, max_bytes, names[0])
    if len(files) == 1 and names[0].lower().endswith(".safetensors"):
        target = workdir / _safe_name(names[0])
        _copy(files[0], target, max_bytes)
        return target
    send = f"send {CONFIG_NAME} with {PEFT_WEIGHTS}, a .zip of a PEFT directory, or one .safetensors file"
    missing = missing_peft_files(names) if CONFIG_NAME in names else None  # half a PEFT directory: name the other half
    raise InputError(", ".join(names), f"{missing}: {send}" if missing else f"not an adapter upload: {send}")


#: characters kept of an uploaded file's name (its suffix always kept: a long `.safetensors` name is still read as one)
MAX_NAME = 128


def _safe_name(name: str) -> str:
    """A file name made of ASCII letters, digits, '-', '_' and '.', not starting with '.' (never a path), at most
    MAX_NAME characters with its suffix (".safetensors", ".zip") kept when the stem is cut."""
    clean = "".join(c if (c.isascii() and c.isalnum()) or c in "-_." else "_" for c in name)
    stem, dot, ext = clean.rpartition(".")
    suffix = dot + ext if dot and 0 < len(ext) <= 16 else ""
    stem = (stem if suffix else clean).lstrip(".")[: MAX_NAME - len(suffix)] or "upload"
    return stem + suffix


def _copy(upload: Upload, target: Path, max_bytes: int) -> None:
    """Copy the stream in chunks, refusing past `max_bytes` (the stream may lie about its length)."""
    written = 0
    with target.open("xb") as out:
        while chunk := upload.stream.read(1 << 20):
            written += len(chunk)
            if written > max_bytes:
                raise UploadTooLarge(upload.filename, f"larger than the upload limit of {max_bytes} bytes")
            out.write(chunk)


def _checked_zip(archive: Path, max_bytes: int, label: str) -> Path:
    """The uploaded zip, once its PEFT members (zoo.formats.archive.peft_members) are found and expand to no more
    than `max_bytes`; it is read into memory from there, never extracted."""
    try:
        with zipfile.ZipFile(archive) as zf:
            wanted = peft_members(zf, label)
    except zipfile.BadZipFile as exc:
        raise InputError(label, f"not a readable zip ({exc})") from None
    if sum(m.file_size for m in wanted.values()) > max_bytes:
        raise UploadTooLarge(label, f"expands past the upload limit of {max_bytes} bytes")
    return archive
