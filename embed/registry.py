"""Embedding spaces, embedders and embeddings in the database, and each embedder's FAISS index.

The database is the source of truth: an index file whose sidecar count or checksum disagrees
with the stored embeddings is rebuilt from them.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from embed.index import AdapterIndex, checksum, sidecar
from embed.types import SpaceSchema
from zoo.db.models import Embedder, Embedding, EmbeddingSpace


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


def active_embedder(session: Session, space: EmbeddingSpace, method: str | None = None) -> Embedder | None:
    """The newest active embedder of the space: W2T if one is trained (or `method` if given), else the sketch."""
    stmt = select(Embedder).where(Embedder.space_id == space.id, Embedder.active.is_(True)).order_by(Embedder.id.desc())
    embedders = list(session.scalars(stmt))
    if method:
        return next((e for e in embedders if e.method == method), None)
    return next((e for e in embedders if e.method == "w2t"), None) or next(iter(embedders), None)


def register(session: Session, space: EmbeddingSpace, method: str, dim: int, **fields: object) -> Embedder:
    """A new active embedder; older active ones of the same method are retired."""
    for old in session.scalars(select(Embedder).where(Embedder.space_id == space.id, Embedder.method == method, Embedder.active.is_(True))):
        old.active = False
    e = Embedder(space_id=space.id, method=method, dim=dim, active=True, **fields)
    session.add(e)
    session.flush()
    return e


def store_embeddings(session: Session, embedder: Embedder, ids: list[int], vectors: np.ndarray) -> None:
    if not ids:
        return
    session.execute(delete(Embedding).where(Embedding.embedder_id == embedder.id, Embedding.adapter_id.in_(ids)))
    session.add_all(
        Embedding(adapter_id=i, embedder_id=embedder.id, vector=np.asarray(v, dtype=np.float32).tobytes())
        for i, v in zip(ids, vectors, strict=True)
    )


def load_embeddings(session: Session, embedder: Embedder) -> tuple[np.ndarray, np.ndarray]:
    rows = session.execute(
        select(Embedding.adapter_id, Embedding.vector).where(Embedding.embedder_id == embedder.id).order_by(Embedding.adapter_id)
    ).all()
    ids = np.array([r[0] for r in rows], dtype=np.int64)
    vectors = np.stack([np.frombuffer(r[1], dtype=np.float32) for r in rows]) if rows else np.zeros((0, embedder.dim), np.float32)
    return ids, vectors


def embedded_ids(session: Session, embedder: Embedder) -> set[int]:
    return set(session.scalars(select(Embedding.adapter_id).where(Embedding.embedder_id == embedder.id)))


def index_path(data_dir: Path, embedder: Embedder) -> Path:
    return data_dir / "index" / f"embedder-{embedder.id}.faiss"


def open_index(session: Session, data_dir: Path, embedder: Embedder, rebuild: bool = False) -> tuple[AdapterIndex, str]:
    """The embedder's index, loaded if it matches the database, else rebuilt and saved.

    Returns the index and how it was obtained: loaded | rebuilt (mismatch) | built (none yet) | rebuilt (asked).
    """
    ids, vectors = load_embeddings(session, embedder)
    digest = checksum(ids, vectors)
    path = index_path(data_dir, embedder)
    state = "rebuilt (asked)" if rebuild else "built"
    if path.exists() and sidecar(path).exists() and not rebuild:
        index, meta = AdapterIndex.load(path)
        if meta.get("count") == len(ids) == index.size and meta.get("checksum") == digest:
            return index, "loaded"
        state = "rebuilt (index disagreed with the database)"
    index = AdapterIndex.build(ids, vectors)
    index.save(path, digest)
    return index, state
