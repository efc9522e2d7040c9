"""Embedders: the ways a space turns adapters into vectors (module sketches, W2T...), one active per method and objective."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from zoo.store.models import Embedder, EmbeddingSpace
from zoo.store.spaces import bump_version


def get_embedder(session: Session, embedder_id: int) -> Embedder:
    """The embedder of this id (one that exists: sqlalchemy's NoResultFound otherwise)."""
    return session.get_one(Embedder, embedder_id)


def find_embedder(session: Session, embedder_id: int) -> Embedder | None:
    """The embedder of this id, or None when there is none."""
    return session.get(Embedder, embedder_id)


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
