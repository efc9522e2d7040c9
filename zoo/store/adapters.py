"""A new adapter's rows as ingest writes them, the reads ingest makes before (a source's stored revision, its previous
version, whether an adapter is still stored, the schema of its space), and adapters read back with their factors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from sqlalchemy import Connection, bindparam, insert, select
from sqlalchemy.orm import Session, selectinload

from zoo.store.models import Adapter, EmbeddingSpace, Label, Measurement, Module
from zoo.store.search_text import write_search_text
from zoo.store.session import Sessions

_ADAPTER_COLUMNS = tuple(c.key for c in Adapter.__table__.columns)
_ADAPTER_EXISTS = select(Adapter.id).where(Adapter.id == bindparam("id"))
_INSERT_ADAPTER = insert(Adapter.__table__).returning(Adapter.__table__.c.id)
_STORED_REVISION = (
    select(Adapter.id, Adapter.canonical_hash, Adapter.name)
    .where(Adapter.source_uri == bindparam("uri"), Adapter.source_revision == bindparam("revision"))
    .order_by(Adapter.id.desc())
    .limit(1)
)
#: the newest stored adapter of a source at another revision
_PREVIOUS_VERSION = (
    select(Adapter.id)
    .where(Adapter.source_uri == bindparam("uri"), Adapter.source_revision != bindparam("revision"))
    .order_by(Adapter.id.desc())
    .limit(1)
)
_SPACE_SCHEMA = select(EmbeddingSpace.schema).where(EmbeddingSpace.base_model == bindparam("base_model")).limit(1)


class StoredRevision(NamedTuple):
    """The stored adapter of a source at one revision."""

    id: int
    canonical_hash: str
    name: str


def stored_revision(sessions: Sessions, uri: str, revision: str) -> StoredRevision | None:
    """The newest stored adapter of this source at this revision, if any (read outside any write transaction)."""
    with sessions() as session:
        row = session.execute(_STORED_REVISION, {"uri": uri, "revision": revision}).first()
    return None if row is None else StoredRevision(row.id, row.canonical_hash, row.name)


def adapter_exists(session: Session, adapter_id: int) -> bool:
    """Whether the adapter is stored, as the session's transaction sees it."""
    return session.connection().execute(_ADAPTER_EXISTS, {"id": adapter_id}).first() is not None


def previous_version(session: Session, uri: str, revision: str) -> int | None:
    """The newest stored adapter of this source at another revision: the one a new revision follows."""
    return session.connection().execute(_PREVIOUS_VERSION, {"uri": uri, "revision": revision}).scalar()


def space_schema(session: Session, base_model: str) -> dict[str, Any] | None:
    """The module schema of the base model's embedding space (None while it has no space, or the space no schema)."""
    return session.connection().execute(_SPACE_SCHEMA, {"base_model": base_model}).scalar()


def insert_adapter(
    session: Session, a: Adapter, modules: Sequence[Mapping[str, Any]], given: Mapping[str, str], measured: Mapping[str, float]
) -> int:
    """Insert a new adapter's row (its id set on `a` and returned), its module rows, its given labels, its test
    measurements and its search document, in the session's transaction."""
    conn = session.connection()
    a.id = conn.execute(_INSERT_ADAPTER, {c: getattr(a, c) for c in _ADAPTER_COLUMNS if c in a.__dict__}).scalar_one()
    _insert_rows(conn, Module, [{**row, "adapter_id": a.id} for row in modules])
    _insert_rows(conn, Label, [{"adapter_id": a.id, "key": k, "value": v, "source": "given"} for k, v in given.items()])
    _insert_rows(conn, Measurement, [{"adapter_id": a.id, "metric": k, "value": v, "split": "test"} for k, v in measured.items()])
    write_search_text(conn, a, given)
    return a.id


def _insert_rows(conn: Connection, model: type[Module | Label | Measurement], rows: Sequence[Mapping[str, object]]) -> None:
    """Rows of a table in one executemany (psycopg pipelines it; the cheapest way for SQLAlchemy and the driver to
    send a few dozen rows: a multi-row VALUES statement costs several times the CPU to build and parse)."""
    if rows:
        conn.execute(insert(model.__table__), rows)


def adapters_with_factors(session: Session, base_model: str, ids: list[int] | None = None) -> list[Adapter]:
    """Every stored adapter of a base model that has canonical factors (only those `ids`, when given), by id, with
    its labels and measurements loaded."""
    stmt = (
        select(Adapter)
        .where(Adapter.base_model == base_model, Adapter.factors_blob.is_not(None))
        .options(selectinload(Adapter.labels), selectinload(Adapter.measurements))
        .order_by(Adapter.id)
    )
    if ids is not None:
        stmt = stmt.where(Adapter.id.in_(ids))
    return list(session.scalars(stmt))


def factor_base_models(session: Session) -> list[str]:
    """The base models of the stored adapters that have canonical factors, sorted."""
    stmt = select(Adapter.base_model).where(Adapter.factors_blob.is_not(None)).distinct().order_by(Adapter.base_model)
    return list(session.scalars(stmt))


class FactorRow(NamedTuple):
    """Where an adapter's factors are and what the detectors need beside them."""

    blob: str | None
    summary: dict | None  # zoo.domain.transforms.FactorSummary as JSON
    dw_norm: float | None  # ‖dW‖_F over all its modules


def factor_rows(sessions: Sessions, ids: list[int]) -> dict[int, FactorRow]:
    """The `FactorRow` of those of these adapters that are stored, in one query."""
    with sessions() as session:
        columns = select(Adapter.id, Adapter.factors_blob, Adapter.factor_summary, Adapter.dw_norm)
        return {i: FactorRow(digest, summary, norm) for i, digest, summary, norm in session.execute(columns.where(Adapter.id.in_(ids)))}
