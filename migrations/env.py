"""Alembic environment: runs migrations online against the URL set by zoo.store.session."""

from __future__ import annotations

from alembic import context

from zoo.store.models import Base, on_dialect
from zoo.store.session import make_engine

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    engine = make_engine(config.get_main_option("sqlalchemy.url"))
    with engine.connect() as connection:
        sqlite = connection.dialect.name == "sqlite"
        if sqlite:  # batch operations copy and drop tables: with foreign keys on, dropping one deletes its children
            connection.connection.driver_connection.execute("PRAGMA foreign_keys=OFF")  # before the transaction begins: a no-op inside one
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
            include_object=on_dialect(connection.dialect.name),
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()
        if sqlite:
            raw = connection.connection.driver_connection
            broken = raw.execute("PRAGMA foreign_key_check").fetchall()
            raw.execute("PRAGMA foreign_keys=ON")
            if broken:
                raise RuntimeError(f"the migration left rows pointing at nothing: {broken[:5]}")


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; run `zoo init` against a database")
run_migrations_online()
