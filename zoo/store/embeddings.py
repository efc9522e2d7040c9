"""Embeddings: the adapters' vectors under each embedder, stamped with the space version that wrote them, and the
tombstones of deleted adapters (see zoo/store/spaces.py for how versions order writes and reads)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from sqlalchemy import Integer, bindparam, delete, func, select
from sqlalchemy.orm import Session

from zoo.store.models import DeletedAdapter, Embedder, Embedding
from zoo.store.spaces import bump_version, space_version


def store_embeddings(session: Session, embedder: Embedder, ids: list[int], vectors: np.ndarray) -> int:
    """Write (or replace) the adapters' vectors under a new space version; returns that version."""
    if not ids:
        return space_version(session, embedder.space_id)
    version = bump_version(session, embedder.space_id)
    session.execute(delete(Embedding).where(Embedding.embedder_id == embedder.id, Embedding.adapter_id.in_(ids)))
    session.add_all(
        Embedding(adapter_id=i, embedder_id=embedder.id, vector=np.asarray(v, dtype=np.float32).tobytes(), version=version)
        for i, v in zip(ids, vectors, strict=True)
    )
    session.flush()
    return version


def deleted_since(session: Session, space_id: int, after_version: int) -> np.ndarray:
    """Ids of the space's adapters deleted after `after_version` (their tombstones' versions)."""
    stmt = select(DeletedAdapter.adapter_id).where(DeletedAdapter.space_id == space_id, DeletedAdapter.version > after_version)
    return np.array(sorted(session.scalars(stmt)), dtype=np.int64)


def stored_count(session: Session, embedder_id: int) -> int:
    """How many adapters have a vector of the embedder."""
    return int(session.scalar(select(func.count()).select_from(Embedding).where(Embedding.embedder_id == embedder_id)) or 0)


def embedding_ids(session: Session, embedder: Embedder, after_version: int = -1) -> np.ndarray:
    """Ids (int64, ascending) of the adapters with a vector of the embedder written after `after_version`."""
    stmt = select(Embedding.adapter_id).where(Embedding.embedder_id == embedder.id, Embedding.version > after_version)
    return np.sort(np.fromiter(session.scalars(stmt), dtype=np.int64))


_IDS = bindparam("ids", type_=Integer, expanding=True, literal_execute=True)  # rendered inline: no bound-parameter limit
#: ids asked for per query by `load_embeddings(..., ids=...)`
IDS_PER_QUERY = 4096


def load_embeddings(
    session: Session, embedder: Embedder, after_version: int = -1, ids: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, vectors) of the embedder's rows written after `after_version` (all by default), by adapter id;
    with `ids`, only the rows of those ids (the ones found), read `IDS_PER_QUERY` ids at a time into one array, by
    the unique key (adapter, embedder) and their version compared here: with the version in the WHERE clause, SQLite
    (no statistics) ranged over the (embedder, version) index instead, every row of the embedder from 3 ids on (the
    relation step's 16 neighbours: 2.4 s an adapter at a million, bench/relations_scale.py)."""
    if ids is None:
        rows = session.execute(
            select(Embedding.adapter_id, Embedding.vector)
            .where(Embedding.embedder_id == embedder.id, Embedding.version > after_version)
            .order_by(Embedding.adapter_id)
        ).all()
        found = np.array([r[0] for r in rows], dtype=np.int64)
        vectors = np.stack([np.frombuffer(r[1], dtype=np.float32) for r in rows]) if rows else np.zeros((0, embedder.dim), np.float32)
        return found, vectors
    return embedding_rows(session, embedder.id, embedder.dim, ids, after_version)


def iter_embeddings(
    session: Session, embedder: Embedder, after_version: int = -1, ids: np.ndarray | None = None, batch: int = 1024
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`load_embeddings` `batch` ids at a time, in id order: (ids, vectors) chunks of the rows of `ids` (default: all
    the embedder's rows written after `after_version`), so that at most one chunk of vectors is in memory."""
    ids = embedding_ids(session, embedder, after_version) if ids is None else np.unique(np.asarray(ids, dtype=np.int64))
    for start in range(0, len(ids), max(1, batch)):
        chunk = load_embeddings(session, embedder, after_version, ids=ids[start : start + max(1, batch)])
        if len(chunk[0]):
            yield chunk


def embedded_ids(session: Session, embedder: Embedder, among: list[int] | None = None) -> set[int]:
    """Ids of the adapters the embedder has a vector for (only those `among`, when given)."""
    stmt = select(Embedding.adapter_id).where(Embedding.embedder_id == embedder.id)
    if among is not None:
        stmt = stmt.where(Embedding.adapter_id.in_(among))
    return set(session.scalars(stmt))


def embedding_rows(session: Session, embedder_id: int, dim: int, ids: np.ndarray, after_version: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """(ids, vectors) of the embedder's rows of those `ids` written after `after_version` (the ones found), ascending:
    `load_embeddings(..., ids=...)` for a caller that holds the embedder's id and dimension, not its row."""
    wanted = np.unique(np.asarray(ids, dtype=np.int64))
    found, vectors, n = np.empty(len(wanted), np.int64), np.empty((len(wanted), dim), np.float32), 0
    stmt = (
        select(Embedding.adapter_id, Embedding.vector, Embedding.version)
        .where(Embedding.embedder_id == embedder_id, Embedding.adapter_id.in_(_IDS))
        .order_by(Embedding.adapter_id)
    )
    conn = session.connection()
    for start in range(0, len(wanted), IDS_PER_QUERY):
        for i, blob, version in conn.execute(stmt, {"ids": wanted[start : start + IDS_PER_QUERY].tolist()}):
            if version > after_version:
                found[n], vectors[n] = i, np.frombuffer(blob, dtype=np.float32)
                n += 1
    return found[:n], vectors[:n]
