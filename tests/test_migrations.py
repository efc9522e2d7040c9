"""The schema comes from the migrations, matches the models, and migrates both ways."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from zoo.db.models import Base, on_dialect
from zoo.db.session import current_revision, downgrade, head_revision, make_engine, upgrade


def test_models_match_migrations(db_url: str) -> None:
    with make_engine(db_url).connect() as conn:
        opts = {"compare_type": True, "include_object": on_dialect(conn.dialect.name)}
        diffs = compare_metadata(MigrationContext.configure(conn, opts=opts), Base.metadata)
    assert diffs == []


def test_downgrade_and_upgrade(db_url: str) -> None:
    assert current_revision(db_url) == head_revision(db_url)
    downgrade(db_url, "base")
    assert "adapter" not in inspect(make_engine(db_url)).get_table_names()
    upgrade(db_url)
    assert {"adapter", "module"} <= set(inspect(make_engine(db_url)).get_table_names())
