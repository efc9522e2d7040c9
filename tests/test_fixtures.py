"""The fixtures' own promise: a PostgreSQL test database is emptied whole between tests, so that no row a test leaves
(a deleted adapter's catalog_change, which no foreign key ties to `adapter`) reaches the seeded zoo's rows or collides
with them when a copy of it is inserted."""

from __future__ import annotations

from sqlalchemy import func, insert, select

from tests.conftest import truncate_all
from zoo.store.models import Base, CatalogChange
from zoo.store.session import make_engine


def test_truncate_all_empties_every_table(pg_url: str) -> None:
    with make_engine(pg_url).begin() as conn:
        conn.execute(insert(CatalogChange).values(adapter_id=4, what="adapter deleted"))
    truncate_all(pg_url)
    with make_engine(pg_url).connect() as conn:
        left = {t.name: n for t in Base.metadata.sorted_tables if (n := conn.execute(select(func.count()).select_from(t)).scalar())}
    assert left == {}
