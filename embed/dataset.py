"""Loading an embedding space's adapters from the database and the blob store."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from embed.types import ZooAdapter
from zoo.blobs import BlobStore
from zoo.db.models import Adapter


def load_adapters(session: Session, blobs: BlobStore, base_model: str, ids: list[int] | None = None) -> list[ZooAdapter]:
    """Every stored LoRA-like adapter of a base model (only those `ids`, when given), with its given labels and test measurements."""
    stmt = (
        select(Adapter)
        .where(Adapter.base_model == base_model, Adapter.factors_blob.is_not(None))
        .options(selectinload(Adapter.labels), selectinload(Adapter.measurements))
        .order_by(Adapter.id)
    )
    if ids is not None:
        stmt = stmt.where(Adapter.id.in_(ids))
    out = []
    for a in session.scalars(stmt):
        out.append(
            ZooAdapter(
                id=a.id,
                name=a.name,
                factors=dict(blobs.get_factors(a.factors_blob)),  # type: ignore[arg-type]
                labels={lb.key: lb.value for lb in a.labels if lb.source == "given"},
                measurements={m.metric: m.value for m in a.measurements if m.split == "test"},
                source_uri=a.source_uri,
            )
        )
    return out


def base_models(session: Session) -> list[str]:
    return list(
        session.scalars(select(Adapter.base_model).where(Adapter.factors_blob.is_not(None)).distinct().order_by(Adapter.base_model))
    )
