"""A space's adapters as embedding and serving read them: by base model, only the LoRA-like ones (with factors),
their ids, names, module shapes and factor digests, and their deletion with a tombstone in the space."""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import Integer, bindparam, func, select
from sqlalchemy.orm import Session

from zoo.store.models import Adapter, CatalogChange, DeletedAdapter, Embedding, Module
from zoo.store.spaces import bump_version

#: the stored adapters with a low-rank update (a full checkpoint has no factors), the ones a space embeds
_LORA = Adapter.factors_blob.is_not(None)
_IDS = bindparam("ids", type_=Integer, expanding=True, literal_execute=True)  # rendered inline: no bound-parameter limit
_NAMES = select(Adapter.id, Adapter.name).where(Adapter.id.in_(_IDS))
_DIGESTS = select(Adapter.id, Adapter.factors_blob).where(Adapter.id.in_(_IDS))


class QueryRow(NamedTuple):
    """What a query by a stored adapter's id needs of it."""

    name: str
    base_model: str
    factors_blob: str | None  # None for a checkpoint


def query_row(session: Session, adapter_id: int) -> QueryRow | None:
    """The adapter's name, base model and factors' digest, through Core (no ORM work on the query path); None if absent."""
    stmt = select(Adapter.name, Adapter.base_model, Adapter.factors_blob).where(Adapter.id == adapter_id)
    row = session.connection().execute(stmt).first()
    return None if row is None else QueryRow(row.name, row.base_model, row.factors_blob)


def adapter_name(session: Session, adapter_id: int) -> str:
    """The name of a stored adapter (one that exists)."""
    return str(session.connection().execute(select(Adapter.name).where(Adapter.id == adapter_id)).scalar_one())


def adapter_names(session: Session, ids: list[int]) -> dict[int, str]:
    """{id: name} of those of the adapters that exist, in one query."""
    return {int(i): str(n) for i, n in session.connection().execute(_NAMES, {"ids": ids})}


def base_model_of(session: Session, adapter_id: int) -> str | None:
    """The adapter's base model; None if there is no such adapter."""
    return session.scalar(select(Adapter.base_model).where(Adapter.id == adapter_id))


def lora_base_models(session: Session, adapter_ids: list[int]) -> list[tuple[str, int]]:
    """(base model, id) of the LoRA-like adapters among `adapter_ids`."""
    rows = session.execute(select(Adapter.base_model, Adapter.id).where(Adapter.id.in_(adapter_ids), _LORA))
    return [(str(b), int(i)) for b, i in rows]


def space_adapter_ids(session: Session, base_model: str) -> list[int]:
    """Ids of a base model's stored LoRA-like adapters, in order."""
    return list(session.scalars(select(Adapter.id).where(Adapter.base_model == base_model, _LORA).order_by(Adapter.id)))


def space_adapter_names(session: Session, base_model: str) -> list[tuple[int, str]]:
    """(id, name) of every stored adapter of a base model, by id: one sequential scan."""
    rows = session.connection().execute(select(Adapter.id, Adapter.name).where(Adapter.base_model == base_model).order_by(Adapter.id))
    return [(int(i), str(n)) for i, n in rows]


def unembedded_ids(session: Session, base_model: str, embedder_id: int) -> list[int]:
    """The base model's stored LoRA-like adapters without a vector of the embedder (one anti-join), in order."""
    vector = select(Embedding.id).where(Embedding.adapter_id == Adapter.id, Embedding.embedder_id == embedder_id)
    stmt = select(Adapter.id).where(Adapter.base_model == base_model, _LORA, ~vector.exists())
    return list(session.scalars(stmt.order_by(Adapter.id)))


def module_shapes(session: Session, base_model: str) -> list[tuple[str, int, int, int, int]]:
    """(name, out, in, adapters with it, the first of them) of each module shape of the base model's LoRA-like adapters,
    from the module table (no blobs)."""
    stmt = (
        select(Module.name, Module.out_features, Module.in_features, func.count(), func.min(Module.adapter_id))
        .join(Adapter, Adapter.id == Module.adapter_id)
        .where(Adapter.base_model == base_model, _LORA)
        .group_by(Module.name, Module.out_features, Module.in_features)
    )
    return [(str(n), int(o), int(i), int(c), int(first)) for n, o, i, c, first in session.execute(stmt)]


def module_ranks(session: Session, base_model: str) -> list[tuple[str, int, int, int]]:
    """(name, out, in, the largest canonical rank stored) of each module shape of the base model's LoRA-like adapters."""
    stmt = (
        select(Module.name, Module.out_features, Module.in_features, func.max(Module.canonical_rank))
        .join(Adapter, Adapter.id == Module.adapter_id)
        .where(Adapter.base_model == base_model, _LORA)
        .group_by(Module.name, Module.out_features, Module.in_features)
    )
    return [(str(n), int(o), int(i), int(r or 0)) for n, o, i, r in session.execute(stmt)]


def factor_elements(session: Session, base_model: str) -> tuple[int, int]:
    """(canonical factor elements in all, adapters) of the base model's LoRA-like adapters, from the module table."""
    stmt = (
        select(
            func.sum((Module.out_features + Module.in_features) * func.coalesce(Module.canonical_rank, 0)),
            func.count(Adapter.id.distinct()),
        )
        .join(Adapter, Adapter.id == Module.adapter_id)
        .where(Adapter.base_model == base_model, _LORA)
    )
    elements, adapters = session.execute(stmt).one()
    return int(elements or 0), int(adapters or 0)


def factor_digests(session: Session, ids: list[int]) -> dict[int, str | None]:
    """{id: the digest of its canonical factors' blob} of those of the adapters that exist."""
    if not ids:
        return {}
    # the ids rendered inline (_IDS): a module store's chunk may name more than one statement may bind (65535)
    return {int(i): d for i, d in session.execute(_DIGESTS, {"ids": [int(i) for i in ids]})}


def delete_adapter(session: Session, adapter_id: int, space_id: int | None) -> str | None:
    """Delete the adapter and its rows, leaving a tombstone under a new version of its space (when it has one) and a
    CatalogChange (which moves the catalog's mark, space or none); its name, or None if there is no such adapter."""
    adapter = session.get(Adapter, adapter_id)
    if adapter is None:
        return None
    if space_id is not None:
        session.add(DeletedAdapter(adapter_id=adapter_id, space_id=space_id, version=bump_version(session, space_id)))
    session.add(CatalogChange(adapter_id=adapter_id, what="adapter deleted"))
    name = adapter.name
    session.delete(adapter)
    return name
