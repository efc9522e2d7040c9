"""`zoo backup DEST` and `zoo restore SRC`: a zoo's database rows, its blobs and its trained checkpoints, and the zoo
brought back from them into an empty database and data dir.

A backup is a directory:

    manifest.json            what it holds: format, zoo version, schema revision, tables (columns, row counts),
                             blobs (digest, bytes), files (path, sha256, bytes); written last, so a backup
                             without one is incomplete
    rows/<table>.jsonl.gz    each table's rows (zoo/store/backup.py: portable between SQLite and PostgreSQL)
    blobs/<xx>/<digest>.safetensors   every blob a row refers to (factors, heads), checked against its digest
    files/embedders/...      trained W2T checkpoints (embedder rows name them): they cannot be derived again

Derived files (FAISS indexes, module stores, maps) are not backed up: a restore rebuilds them from the rows, as any
node with an empty disk does.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TypedDict

from tqdm import tqdm

from zoo import __version__
from zoo.config import Settings
from zoo.errors import UsageError
from zoo.files import file_sha256
from zoo.store import backup as rows
from zoo.store.blob_backends import open_blob_store
from zoo.store.session import current_revision, make_engine, require_schema, session_factory, upgrade
from zoo.store.shared_files import local_folder, publish
from zoo.store.spaces import all_spaces

FORMAT = "zoo-backup"
VERSION = 1
MANIFEST = "manifest.json"


class BlobEntry(TypedDict):
    digest: str
    bytes: int
    file: str


class FileEntry(TypedDict):
    path: str  # under the data dir
    sha256: str
    bytes: int


class Manifest(TypedDict):
    format: str
    version: int
    created_at: str
    zoo_version: str
    database: dict[str, str | None]
    tables: dict[str, rows.TableDump]
    blobs: list[BlobEntry]
    files: list[FileEntry]


class BackupReport(TypedDict):
    """What `zoo backup` wrote (and `zoo restore` read back)."""

    path: str
    revision: str | None
    rows: dict[str, int]
    blobs: int
    blob_bytes: int
    files: int
    file_bytes: int
    seconds: float


class RestoreReport(BackupReport):
    rebuilt: dict[str, dict[str, object]]  # each space's derived files, as `zoo embed` reports them


def _bar(total: int, desc: str, unit: str, progress: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", disable=not progress, file=sys.stderr, leave=False)


def _digests(dest: Path, tables: dict[str, rows.TableDump]) -> list[str]:
    """The blobs the backed-up rows refer to: the adapters' factors and heads, as dumped (one snapshot with them)."""
    dump = tables["adapter"]
    names = [name for name, _ in dump["columns"]]
    at = [names.index(c) for c in ("factors_blob", "head_blob") if c in names]
    found: set[str] = set()
    with gzip.open(dest / dump["file"], "rt", encoding="utf-8") as fh:
        for line in fh:
            values = json.loads(line)
            found.update(str(values[i]) for i in at if values[i])
    return sorted(found)


def _checkpoint_files(data_dir: Path, checkpoints: list[str]) -> Iterator[tuple[str, Path]]:
    """(path under the data dir, file) of every file of the embedders' checkpoints; a checkpoint outside the data dir is
    refused, a missing one is an error (its embedder could not be loaded after a restore)."""
    root = data_dir.resolve()
    for checkpoint in checkpoints:
        where = (data_dir / checkpoint).resolve()
        if not where.is_relative_to(root):
            raise UsageError(f"the embedder checkpoint {checkpoint} lies outside the data dir: it cannot be backed up")
        if not where.exists():
            raise UsageError(f"the embedder checkpoint {checkpoint} is missing from the data dir: run `zoo check`")
        files = sorted(p for p in where.rglob("*") if p.is_file()) if where.is_dir() else [where]
        for f in files:
            yield str(f.relative_to(root)), f


def _write_manifest(dest: Path, manifest: Manifest) -> None:
    tmp = dest / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, dest / MANIFEST)


def backup(settings: Settings, dest: Path, progress: bool = False) -> BackupReport:
    """Write a backup of the zoo into `dest` (a new or empty directory): see the module's doc."""
    require_schema(settings.database_url)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UsageError(f"{dest} exists and is not an empty directory: back up into a new one")
    dest.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    url = settings.database_url
    revision = current_revision(url)
    counts = rows.row_counts(url)
    with _bar(sum(counts.values()), "rows", "row", progress) as bar:
        tables = rows.dump_rows(url, dest, lambda _table, n: bar.update(n))
    store = open_blob_store(settings)  # the data dir's blobs/ or the bucket ZOO_BLOB_URL names
    blobs: list[BlobEntry] = []
    digests = _digests(dest, tables)
    with _bar(len(digests), "blobs", "blob", progress) as bar:
        for digest in digests:
            file = f"blobs/{digest[:2]}/{digest}.safetensors"
            copied = rows.blob_out(store, digest, dest / file)
            blobs.append({"digest": digest, "bytes": copied.bytes, "file": file})
            bar.update()
    files: list[FileEntry] = []
    checkpoints = rows.embedder_checkpoints(url)
    for checkpoint in checkpoints:  # with blobs in a bucket, a checkpoint another node trained is fetched from there
        with contextlib.suppress(FileNotFoundError, ValueError):  # missing everywhere: _checkpoint_files says so
            local_folder(store, settings.data_dir, checkpoint)
    for relative, path in _checkpoint_files(settings.data_dir, checkpoints):
        target = dest / "files" / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
        files.append({"path": relative, "sha256": file_sha256(target), "bytes": target.stat().st_size})
    manifest: Manifest = {
        "format": FORMAT,
        "version": VERSION,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "zoo_version": __version__,
        "database": {"dialect": make_engine(url).dialect.name, "revision": revision},
        "tables": tables,
        "blobs": blobs,
        "files": files,
    }
    _write_manifest(dest, manifest)
    return _report(dest, manifest, time.perf_counter() - start)


def _report(path: Path, manifest: Manifest, seconds: float) -> BackupReport:
    return {
        "path": str(path),
        "revision": manifest["database"]["revision"],
        "rows": {name: t["rows"] for name, t in manifest["tables"].items()},
        "blobs": len(manifest["blobs"]),
        "blob_bytes": sum(b["bytes"] for b in manifest["blobs"]),
        "files": len(manifest["files"]),
        "file_bytes": sum(f["bytes"] for f in manifest["files"]),
        "seconds": round(seconds, 3),
    }


def read_manifest(src: Path) -> Manifest:
    """A backup's manifest, checked to be one this zoo reads."""
    try:
        manifest = json.loads((src / MANIFEST).read_text())
    except FileNotFoundError:
        raise UsageError(f"{src} holds no {MANIFEST}: not a backup, or one that did not finish") from None
    except json.JSONDecodeError as exc:
        raise UsageError(f"{src / MANIFEST} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UsageError(f"{src / MANIFEST} is not a zoo backup's manifest")
    if manifest.get("version") != VERSION:
        raise UsageError(f"{src} is a backup of format version {manifest.get('version')}; this zoo reads version {VERSION}")
    return manifest  # type: ignore[return-value]


def _prepare_database(url: str, revision: str | None) -> None:
    """The target database at the backup's schema revision, and empty: a new database is migrated to it."""
    current = current_revision(url)
    if current is None:
        try:
            upgrade(url, revision or "base")
        except Exception as exc:  # noqa: BLE001 - alembic names an unknown revision in its own words
            known = f"the backup's schema revision {revision} is unknown to this zoo ({exc})"
            raise UsageError(f"{known}: restore with the zoo that made it") from None
        return
    if current != revision:
        raise UsageError(
            f"the database is at schema {current} and the backup at {revision}: restore into a new, empty database "
            "(restore migrates it to the backup's schema, then to this zoo's)"
        )
    if not rows.is_empty(url):
        raise UsageError("the database already holds a zoo (adapters, spaces, jobs or tokens): restore into a new, empty database")


def restore(settings: Settings, src: Path, progress: bool = False) -> RestoreReport:
    """Bring a backup back into the configured database (new or empty) and data dir: rows at the backup's schema, then
    migrated to this zoo's; every blob and checkpoint file checked against its hash; derived files rebuilt."""
    from embed.serving.embedding_resource import refresh_space_files

    manifest = read_manifest(src)
    start = time.perf_counter()
    url = settings.database_url
    _prepare_database(url, manifest["database"]["revision"])
    store = open_blob_store(settings)
    with _bar(len(manifest["blobs"]), "blobs", "blob", progress) as bar:
        for blob in manifest["blobs"]:  # blobs first: no committed row ever points at a missing blob
            rows.blob_in(store, blob["digest"], src / blob["file"])
            bar.update()
    root = settings.data_dir.resolve()
    for entry in manifest["files"]:
        target = (settings.data_dir / entry["path"]).resolve()
        if not target.is_relative_to(root):
            raise UsageError(f"the backup's file {entry['path']} would go outside the data dir")
        source = src / "files" / entry["path"]
        if file_sha256(source) != entry["sha256"]:
            raise UsageError(f"the backup's file {entry['path']} is corrupt (its sha256 differs from the manifest's)")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    with _bar(sum(t["rows"] for t in manifest["tables"].values()), "rows", "row", progress) as bar:
        rows.load_rows(url, src, manifest["tables"], lambda _table, n: bar.update(n))
    for checkpoint in rows.embedder_checkpoints(url):  # with blobs in a bucket, every node fetches them from there
        if (settings.data_dir / checkpoint).is_dir():
            publish(store, settings.data_dir, checkpoint)
    upgrade(url)
    sessions = session_factory(url)
    rebuilt: dict[str, dict[str, object]] = {}
    with sessions() as session:
        spaces = [(space.id, space.name) for space in all_spaces(session)]
    for space_id, name in spaces:
        rebuilt[name] = dict(refresh_space_files(sessions, store, settings.data_dir, space_id))
    return {**_report(src, manifest, time.perf_counter() - start), "rebuilt": rebuilt}
