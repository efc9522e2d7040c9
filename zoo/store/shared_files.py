"""Folders one node writes under its data dir that other nodes need: trained W2T checkpoints (`embedders/<name>/`,
which cannot be derived again) and a web upload waiting for its job item (`uploads/<hex>/`, which any worker may
claim).

With blobs in the data dir (the default) every node shares that directory, and these functions only say where the
folder is. With blobs in a bucket (ZOO_BLOB_URL, zoo/store/s3_blobs.py) a folder goes up beside the blobs, as
`<prefix>files/<folder>/<file>`, followed by `<folder>/MANIFEST.json` (each file's bytes and SHA-256), written last:
a folder without its manifest is unfinished and never fetched. A node that lacks the folder fetches it into its own
data dir on first use, checks every file against the manifest, and renames the whole folder into place, so a reader
sees all of it or none.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from zoo.errors import StorageError
from zoo.files import TMP_PREFIX, file_sha256
from zoo.store.blobs import BlobStore
from zoo.store.s3_blobs import S3BlobStore

#: the file, uploaded last, that lists a folder's files and makes it complete
MANIFEST = "MANIFEST.json"


class CorruptFile(StorageError):
    """A fetched file whose bytes differ from what its folder's manifest says."""


def _checked(folder: str) -> str:
    """`folder` as a relative POSIX path that stays inside the data dir."""
    path = PurePosixPath(folder)
    if path.is_absolute() or not path.parts or ".." in path.parts:
        raise ValueError(f"{folder!r} is not a folder under the data dir")
    return str(path)


def in_bucket(blobs: BlobStore) -> bool:
    """Whether `publish` puts folders in a bucket (else other nodes must share this node's data dir)."""
    return isinstance(blobs, S3BlobStore)


def publish(blobs: BlobStore, data_dir: Path, folder: str) -> None:
    """Make `data_dir/folder` (written whole, never changed after) reachable from every node: with a bucket, upload
    its files, then its manifest; with the data dir's blobs, nothing to do."""
    if not isinstance(blobs, S3BlobStore):
        return
    folder = _checked(folder)
    root = data_dir / folder
    files = sorted(p for p in root.rglob("*") if p.is_file())
    listed: dict[str, dict[str, object]] = {}
    for path in files:
        name = path.relative_to(root).as_posix()
        blobs.put_file_object(f"{folder}/{name}", path)
        listed[name] = {"sha256": file_sha256(path), "bytes": path.stat().st_size}
    with tempfile.TemporaryDirectory(prefix=TMP_PREFIX) as tmp:
        manifest = Path(tmp) / MANIFEST
        manifest.write_text(json.dumps({"files": listed}, indent=1, sort_keys=True))
        blobs.put_file_object(f"{folder}/{MANIFEST}", manifest)


def local_folder(blobs: BlobStore, data_dir: Path, folder: str) -> Path:
    """`data_dir/folder`, fetched from the bucket first where this node lacks it (FileNotFoundError where the bucket
    has no complete copy either, CorruptFile where a file differs from the manifest). With the data dir's blobs, the
    path as it is."""
    target = data_dir / folder
    if not isinstance(blobs, S3BlobStore) or target.exists():
        return target
    folder = _checked(folder)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=target.parent))
    try:
        blobs.get_file_object(f"{folder}/{MANIFEST}", tmp / MANIFEST)
        listed = json.loads((tmp / MANIFEST).read_text())["files"]
        (tmp / MANIFEST).unlink()
        for name, entry in listed.items():
            path = tmp / _checked(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            blobs.get_file_object(f"{folder}/{name}", path)
            if file_sha256(path) != entry["sha256"]:
                raise CorruptFile(f"{blobs.file_key(folder + '/' + name)} in {blobs.url} differs from its manifest's SHA-256")
        try:
            os.rename(tmp, target)  # the whole folder at once
        except OSError:  # another process of this node fetched it meanwhile
            if not target.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def unpublish(blobs: BlobStore, folder: str) -> int:
    """Remove a published folder's copy from the bucket (an upload whose item is finished, or one a killed writer left),
    uploads of its files cut off mid-way included; how many files went."""
    if not isinstance(blobs, S3BlobStore):
        return 0
    folder = _checked(folder)
    return blobs.delete_file_objects(folder) + blobs.abort_file_uploads(folder)


@dataclass(frozen=True)
class PublishedFolder:
    """A folder kept in the bucket (`folder`, e.g. uploads/<hex>), as listed: `where` it is, how many files it holds
    (objects, and uploads of one under way or cut off), when it was last written to, and whether its manifest is there
    (without one, its writer has not finished, or was killed)."""

    folder: str
    where: str
    files: int
    last_written: float
    complete: bool


def published_folders(blobs: BlobStore, under: str) -> list[PublishedFolder]:
    """The folders kept in the bucket under `under` (e.g. "uploads"), by name; none with the data dir's blobs."""
    if not isinstance(blobs, S3BlobStore):
        return []
    under = _checked(under)
    grouped: dict[str, list[tuple[str, float]]] = {}
    for name, when in blobs.file_entries(under):
        rest = name[len(under) + 1 :]
        if "/" in rest:  # a file directly under `under` belongs to no folder
            grouped.setdefault(f"{under}/{rest.split('/', 1)[0]}", []).append((name, when))
    return [
        PublishedFolder(
            folder,
            f"s3://{blobs.location.bucket}/{blobs.file_key(folder)}/",
            len(entries),
            max(when for _, when in entries),
            any(name == f"{folder}/{MANIFEST}" for name, _ in entries),
        )
        for folder, entries in sorted(grouped.items())
    ]
