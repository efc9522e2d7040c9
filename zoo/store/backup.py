"""A database's rows in a portable form, and blobs copied in and out by their digests: what `zoo backup` writes and
`zoo restore` reads (zoo/services/backup.py puts them together).

Rows go out table by table, parents first, as gzipped JSON lines (one list of values a row, in the order of the
table's columns as the manifest names them), read in one snapshot. Values that JSON has no form for are written by
their column's kind: bytes as base64, times as ISO 8601, non-finite floats as strings. No dialect's own format is
involved, so a backup of SQLite restores into PostgreSQL and the other way round; generated columns (PostgreSQL's
tsvector) and SQLite's full-text tables are left out, and rebuild themselves from the rows.

Rows come back into a database at the backup's schema revision (migrated to it first, so a backup made by an older
zoo restores into its own schema and is then migrated on like any database), parents first, a table's references to
its own rows set once every row is in, and PostgreSQL's id sequences moved past the restored ids.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Literal, TypedDict

from sqlalchemy import JSON, DateTime, Float, LargeBinary, MetaData, Table, func, select, text, update
from sqlalchemy.engine import Connection

from zoo.errors import UsageError
from zoo.files import TMP_PREFIX
from zoo.store.blobs import BlobStore
from zoo.store.models import Base, Embedder
from zoo.store.s3_blobs import CorruptBlob, S3BlobStore
from zoo.store.session import make_engine

#: how a column's values are written (see the module's doc)
Kind = Literal["bytes", "time", "float", "json", "plain"]
#: rows inserted in one statement
BATCH = 500
#: the tables whose rows make a zoo not empty: a restore goes only into a database without any
CONTENT_TABLES = ("adapter", "embedding_space", "job", "api_token")


class TableDump(TypedDict):
    """One table in a backup: its columns (name and kind, in the order of each row's values) and its row count."""

    file: str
    columns: list[list[str]]
    rows: int


Progress = Callable[[str, int], object]


def _kind(column_type: object) -> Kind:
    if isinstance(column_type, LargeBinary):
        return "bytes"
    if isinstance(column_type, DateTime):
        return "time"
    if isinstance(column_type, Float):
        return "float"
    if isinstance(column_type, JSON):
        return "json"
    return "plain"


def _encode(kind: Kind, value: object) -> object:
    if value is None:
        return None
    if kind == "bytes":
        return base64.b64encode(value if isinstance(value, bytes) else bytes(value)).decode()  # type: ignore[call-overload]
    if kind == "time":
        return value.isoformat()  # type: ignore[attr-defined]
    if kind == "float" and isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # nan, inf, -inf
    return value


def _decode(kind: str, value: object) -> object:
    if value is None:
        return None
    if kind == "bytes":
        return base64.b64decode(str(value))
    if kind == "time":
        return datetime.fromisoformat(str(value))
    if kind == "float" and isinstance(value, str):
        return float(value)
    return value


def dumped_tables() -> list[Table]:
    """The tables a backup holds, parents first: every table of the schema (none of SQLite's full-text ones)."""
    return list(Base.metadata.sorted_tables)


def dump_rows(url: str, out_dir: Path, progress: Progress | None = None) -> dict[str, TableDump]:
    """Every row of every table into out_dir/rows/<table>.jsonl.gz, read in one snapshot (PostgreSQL: REPEATABLE READ;
    SQLite: one read transaction). `progress(table, rows)` is called as rows go out."""
    rows_dir = out_dir / "rows"
    rows_dir.mkdir(parents=True, exist_ok=True)
    engine = make_engine(url)
    tables: dict[str, TableDump] = {}
    options = {"isolation_level": "REPEATABLE READ"} if engine.dialect.name == "postgresql" else {}
    with engine.connect().execution_options(**options) as conn, conn.begin():
        for table in dumped_tables():
            columns = [c for c in table.c if c.computed is None]
            kinds = [_kind(c.type) for c in columns]
            order = list(table.primary_key.columns) or columns
            name = f"rows/{table.name}.jsonl.gz"
            count = 0
            with gzip.open(out_dir / name, "wt", encoding="utf-8", compresslevel=6) as fh:
                result = conn.execution_options(yield_per=BATCH).execute(select(*columns).order_by(*order))
                for row in result:
                    fh.write(json.dumps([_encode(k, v) for k, v in zip(kinds, row, strict=True)], separators=(",", ":")) + "\n")
                    count += 1
                    if progress is not None and count % BATCH == 0:
                        progress(table.name, BATCH)
            if progress is not None and count % BATCH:
                progress(table.name, count % BATCH)
            tables[table.name] = {"file": name, "columns": [[c.name, k] for c, k in zip(columns, kinds, strict=True)], "rows": count}
    return tables


def row_counts(url: str) -> dict[str, int]:
    """Rows per table, as a backup counts them (progress totals)."""
    with make_engine(url).connect() as conn:
        return {t.name: int(conn.scalar(select(func.count()).select_from(t)) or 0) for t in dumped_tables()}


def embedder_checkpoints(url: str) -> list[str]:
    """The directories (under the data dir) of every embedder's trained checkpoint."""
    with make_engine(url).connect() as conn:
        return sorted({str(c) for c in conn.scalars(select(Embedder.checkpoint).where(Embedder.checkpoint.is_not(None)))})


def is_empty(url: str) -> bool:
    """Whether the database holds no adapters, spaces, jobs or tokens (what a restore may go into)."""
    with make_engine(url).connect() as conn:
        meta = MetaData()
        meta.reflect(conn, only=list(CONTENT_TABLES))
        return all(not conn.scalar(select(func.count()).select_from(meta.tables[name])) for name in CONTENT_TABLES)


def _read_rows(path: Path) -> Iterator[list[object]]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            yield json.loads(line)


def _self_references(table: Table) -> list[str]:
    """The columns of `table` that refer to its own rows (adapter.previous_version_id)."""
    return [fk.parent.name for fk in table.foreign_keys if fk.column.table.name == table.name]


def load_rows(url: str, in_dir: Path, tables: dict[str, TableDump], progress: Progress | None = None) -> dict[str, int]:
    """The rows of a backup into the database at `url` (at the backup's schema, empty), in one transaction: parents first,
    references of a table to its own rows once all its rows are in, PostgreSQL's id sequences past the largest id."""
    engine = make_engine(url)
    counts: dict[str, int] = {}
    with engine.begin() as conn:
        meta = MetaData()
        meta.reflect(conn, only=list(tables))
        for table in meta.sorted_tables:
            dump = tables[table.name]
            names = [name for name, _ in dump["columns"]]
            kinds = [kind for _, kind in dump["columns"]]
            missing = [n for n in names if n not in table.c]
            if missing:
                raise UsageError(f"the backup's table {table.name} has columns this database lacks: {', '.join(missing)}")
            later = _self_references(table)
            key = [c.name for c in table.primary_key.columns]
            deferred: list[dict[str, object]] = []
            batch: list[dict[str, object]] = []
            count = 0
            for values in _read_rows(in_dir / dump["file"]):
                row = {n: _decode(k, v) for n, k, v in zip(names, kinds, values, strict=True)}
                if any(row.get(c) is not None for c in later):
                    deferred.append({**{k: row[k] for k in key}, **{c: row[c] for c in later}})
                    row.update(dict.fromkeys(later))
                batch.append(row)
                if len(batch) >= BATCH:
                    count += _insert(conn, table, batch, progress)
            count += _insert(conn, table, batch, progress)
            for ref in deferred:
                conn.execute(update(table).where(*(table.c[k] == ref[k] for k in key)).values({c: ref[c] for c in later}))
            counts[table.name] = count
        if conn.dialect.name == "postgresql":
            _move_sequences(conn, meta)
    return counts


def _insert(conn: Connection, table: Table, batch: list[dict[str, object]], progress: Progress | None) -> int:
    if not batch:
        return 0
    conn.execute(table.insert(), batch)
    n = len(batch)
    if progress is not None:
        progress(table.name, n)
    batch.clear()
    return n


def _move_sequences(conn: Connection, meta: MetaData) -> None:
    """Each serial id's sequence past the largest restored id, so that the next row inserted takes a new one."""
    for table in meta.sorted_tables:
        key = list(table.primary_key.columns)
        if len(key) != 1 or table.name not in {t.name for t in dumped_tables()}:
            continue
        column = key[0].name
        sequence = conn.scalar(text("SELECT pg_get_serial_sequence(:t, :c)"), {"t": table.name, "c": column})
        if sequence:
            top = conn.scalar(select(func.max(table.c[column])))
            conn.execute(
                text("SELECT setval(CAST(:s AS regclass), :v, :called)"), {"s": sequence, "v": top or 1, "called": top is not None}
            )


# --- blobs -----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CopiedBlob:
    digest: str
    bytes: int


class CorruptBlobError(UsageError):
    """A blob whose bytes do not hash to its digest (or that is missing), met while copying it."""


def _copy_hashed(src: IO[bytes], dst: IO[bytes] | None) -> tuple[str, int]:
    """(sha256, bytes) of src, read to its end; written to dst as it goes (where there is one)."""
    h, size = hashlib.sha256(), 0
    while chunk := src.read(1 << 20):
        h.update(chunk)
        if dst is not None:
            dst.write(chunk)
        size += len(chunk)
    return h.hexdigest(), size


def blob_out(store: BlobStore, digest: str, dest: Path) -> CopiedBlob:
    """A stored blob (in a local directory or a bucket) copied to `dest`, its bytes checked against its digest on the
    way: CorruptBlobError where they do not hash to it or it is missing."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(store, S3BlobStore):
        try:
            data = store.read_bytes(digest)  # verified against the digest as it is read
        except FileNotFoundError:
            raise CorruptBlobError(f"blob {store.where(digest)} is missing: run `zoo check`") from None
        except CorruptBlob as exc:
            raise CorruptBlobError(f"{exc}") from None
        dest.write_bytes(data)
        return CopiedBlob(digest, len(data))
    try:
        with store.path(digest).open("rb") as src, dest.open("wb") as dst:
            got, size = _copy_hashed(src, dst)
    except FileNotFoundError:
        dest.unlink(missing_ok=True)
        raise CorruptBlobError(f"blob {digest} is missing from the blob store: run `zoo check`") from None
    if got != digest:
        dest.unlink(missing_ok=True)
        raise CorruptBlobError(f"blob {digest} is corrupt in the blob store (its bytes hash to {got}): run `zoo check`")
    return CopiedBlob(digest, size)


def check_blob(digest: str, src: Path) -> int:
    """The size of a backed-up blob, once its bytes are found to hash to its digest (CorruptBlobError otherwise)."""
    with src.open("rb") as fh:
        got, size = _copy_hashed(fh, None)
    if got != digest:
        raise CorruptBlobError(f"the backup's blob {digest} is corrupt (its bytes hash to {got})")
    return size


def blob_in(store: BlobStore, digest: str, src: Path) -> CopiedBlob:
    """A backed-up blob put in the store under its digest, checked against it first (`check_blob`); never visible
    half-written: a temporary file renamed into place, or an object that appears whole when its upload completes."""
    size = check_blob(digest, src)
    if isinstance(store, S3BlobStore):
        store.put_file(digest, src)
        return CopiedBlob(digest, size)
    target = store.path(digest)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=TMP_PREFIX, suffix=".safetensors")  # `zoo check` sees a leftover
    tmp = Path(name)
    try:
        with src.open("rb") as fh, os.fdopen(fd, "wb") as out:
            got, _ = _copy_hashed(fh, out)
            out.flush()
            os.fsync(out.fileno())
        if got != digest:  # changed since it was checked
            raise CorruptBlobError(f"the backup's blob {digest} is corrupt (its bytes hash to {got})")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return CopiedBlob(digest, size)
