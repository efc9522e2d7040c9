"""Embedding spaces, embedders and embeddings in the database (index files live in embed/indexfiles.py).

Every write of a space's embeddings bumps the space's `version` first, in the same transaction,
and stamps the rows it writes with the new version. The UPDATE takes the space row's lock, so
writers of one space commit in version order, and a reader that has seen version v learns of
everything newer by loading the rows stamped above v: no O(N) check.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
from sqlalchemy import Integer, bindparam, delete, select, update
from sqlalchemy.orm import Session

from embed.types import SpaceSchema
from zoo.store.models import DeletedAdapter, Embedder, Embedding, EmbeddingSpace


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "space"


def get_space(session: Session, name: str) -> EmbeddingSpace | None:
    return session.scalars(select(EmbeddingSpace).where(EmbeddingSpace.name == name)).one_or_none()


def ensure_space(session: Session, schema: SpaceSchema) -> EmbeddingSpace:
    """The space of a base model, its module vocabulary widened to include `schema`'s."""
    space = get_space(session, schema.base_model)
    if space is None:
        space = EmbeddingSpace(name=schema.base_model, base_model=schema.base_model, schema=schema.as_dict())
        session.add(space)
        session.flush()
        return space
    known = {str(n): (int(o), int(i)) for n, o, i in space.schema["modules"]}
    new = [(n, o, i) for n, o, i in schema.modules if n not in known]
    if new:  # a module name keeps the shape it has: ingest refuses adapters that disagree with it
        merged = sorted([(n, o, i) for n, (o, i) in known.items()] + new)
        space.schema = {"base_model": space.base_model, "modules": [list(m) for m in merged]}
        session.flush()
    return space


def bump_version(session: Session, space_id: int) -> int:
    """Increment the space's version (taking its row lock until commit) and return the new value."""
    session.execute(update(EmbeddingSpace).where(EmbeddingSpace.id == space_id).values(version=EmbeddingSpace.version + 1))
    return int(session.execute(select(EmbeddingSpace.version).where(EmbeddingSpace.id == space_id)).scalar_one())


_VERSION = select(EmbeddingSpace.version).where(EmbeddingSpace.id == bindparam("space_id"))


def space_version(session: Session, space_id: int) -> int:
    """The space's version: one indexed read through Core (every query asks it)."""
    return int(session.connection().execute(_VERSION, {"space_id": space_id}).scalar() or 0)


def active_embedders(session: Session, space_id: int) -> list[Embedder]:
    """The space's active embedders, newest first."""
    stmt = select(Embedder).where(Embedder.space_id == space_id, Embedder.active.is_(True)).order_by(Embedder.id.desc())
    return list(session.scalars(stmt))


def serving_embedders(session: Session, space_id: int) -> dict[str, Embedder]:
    """The embedder that serves each method of the space: the newest active one, and for W2T the newest
    supervised one when there is one (a contrastive W2T has no heads for predictions or the hybrid)."""
    out: dict[str, Embedder] = {}
    for e in sorted(active_embedders(session, space_id), key=lambda e: e.method == "w2t" and e.objective == "contrastive"):
        out.setdefault(e.method, e)
    return out


def active_embedder(session: Session, space: EmbeddingSpace, method: str | None = None) -> Embedder | None:
    """The embedder serving `method` (see serving_embedders), or without one: W2T if trained, else the sketch."""
    serving = serving_embedders(session, space.id)
    if method:
        return serving.get(method)
    return serving.get("w2t") or serving.get("module_sketch")


def register(session: Session, space: EmbeddingSpace, method: str, dim: int, retire: tuple[str, ...] = (), **fields: object) -> Embedder:
    """A new active embedder. Older active ones of the same method and objective (or of a method in
    `retire`) are retired: a contrastive W2T does not retire the supervised one."""
    bump_version(session, space.id)
    objective = fields.get("objective")
    same = (Embedder.method == method) & (Embedder.objective.is_(None) if objective is None else Embedder.objective == objective)
    stmt = select(Embedder).where(Embedder.space_id == space.id, same | Embedder.method.in_(retire), Embedder.active.is_(True))
    for old in session.scalars(stmt):
        old.active = False
    e = Embedder(space_id=space.id, method=method, dim=dim, active=True, **fields)
    session.add(e)
    session.flush()
    return e


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
    wanted = np.unique(np.asarray(ids, dtype=np.int64))
    found, vectors, n = np.empty(len(wanted), np.int64), np.empty((len(wanted), embedder.dim), np.float32), 0
    stmt = (
        select(Embedding.adapter_id, Embedding.vector, Embedding.version)
        .where(Embedding.embedder_id == embedder.id, Embedding.adapter_id.in_(_IDS))
        .order_by(Embedding.adapter_id)
    )
    conn = session.connection()
    for start in range(0, len(wanted), IDS_PER_QUERY):
        for i, blob, version in conn.execute(stmt, {"ids": wanted[start : start + IDS_PER_QUERY].tolist()}):
            if version > after_version:
                found[n], vectors[n] = i, np.frombuffer(blob, dtype=np.float32)
                n += 1
    return found[:n], vectors[:n]


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
