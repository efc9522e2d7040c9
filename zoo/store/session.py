"""Engine and session setup from one URL, and the schema check every command relies on.

Pooled connections never cross a fork. `zoo serve` checks the schema in gunicorn's master, which then forks its
workers: each inherited the master's engine (make_engine is cached per URL) with the master's connection in its
pool, so two worker processes spoke over one PostgreSQL socket. One worker's BEGIN left the other's connection
`INTRANS` (its pre-ping then failed: "can't change 'autocommit' now: connection in transaction status INTRANS"),
and replies meant for one process were read by the other (`ResourceClosedError` on a SELECT whose rows the other
had taken): intermittent 500s under concurrent load. A forked child now starts every engine with an
empty pool (`dispose(close=False)`: the parent's connections are left to the parent, unclosed).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

import migrations
from zoo.errors import ZooError
from zoo.store.locks import take_locks

if TYPE_CHECKING:
    import sqlite3

    from sqlalchemy.pool import ConnectionPoolEntry

#: how long a SQLite writer waits for another process's write lock
SQLITE_BUSY_MS = 60_000
#: execution option marking a write transaction (see write_transaction)
WRITE_OPTION = "zoo_write"


#: a factory of sessions on one database: what code outside the store holds and hands to store functions
Sessions: TypeAlias = sessionmaker[Session]


#: every engine made in this process, so that a forked child can drop the connections it inherited
_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


def _forget_inherited_connections() -> None:
    """In a forked child: a fresh pool for every engine. The parent's connections are not closed (closing one
    would end the parent's session on the server) nor ever used here."""
    for engine in list(_ENGINES):
        engine.dispose(close=False)


os.register_at_fork(after_in_child=_forget_inherited_connections)


@cache
def make_engine(url: str) -> Engine:
    """One engine per URL; SQLite gets foreign keys on and its parent directory created. Its pool starts empty in a
    forked child (module doc)."""
    engine = _make_engine(url)
    _ENGINES.add(engine)
    return engine


def _make_engine(url: str) -> Engine:
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: sqlite3.Connection, _record: ConnectionPoolEntry) -> None:
            dbapi_conn.isolation_level = None  # transactions are begun below, not by the driver
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_MS}")
            if parsed.database and parsed.database != ":memory:":
                cur.execute("PRAGMA journal_mode=WAL")  # readers go on while one process writes
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Connection) -> None:
            # a writer takes the write lock when it begins (waiting up to the busy timeout), so that
            # what it read before writing cannot be changed under it by another process
            conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(WRITE_OPTION) else "BEGIN")

        return engine
    return create_engine(url, pool_pre_ping=True)


def session_factory(url: str) -> Sessions:
    return sessionmaker(bind=make_engine(url), expire_on_commit=False)


def shown_url(url: str) -> str:
    """The database URL as messages show it: its password hidden."""
    return make_url(url).render_as_string(hide_password=True)


@contextmanager
def write_transaction(sessions: Sessions, *lock_keys: str) -> Iterator[Session]:
    """A session in one write transaction, committed at the end, serialized against other writers
    holding any of `lock_keys`: PostgreSQL takes a transaction-level advisory lock per key; SQLite
    begins IMMEDIATE (one writer at a time, others wait up to the busy timeout)."""
    with sessions() as session, session.begin():
        session.connection(execution_options={WRITE_OPTION: True})
        take_locks(session, *lock_keys)
        yield session


@contextmanager
def autocommit_reads(sessions: Sessions) -> Iterator[Connection]:
    """A connection for reads only, each statement on its own (no transaction held around them)."""
    with sessions() as session:
        yield session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})


def read_snapshot(session: Session) -> Session:
    """The session, its next transaction reading one snapshot: REPEATABLE READ on PostgreSQL, whose default (READ
    COMMITTED) takes a snapshot per statement, so that rows one statement read (a catalog page's adapters) can be
    gone by the next (their labels) when another process deletes them between. SQLite's read transactions read one
    snapshot already. Only where the session's transaction has not begun (else it reads as it began)."""
    if not session.in_transaction() and session.get_bind().dialect.name == "postgresql":
        session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
    return session


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Create or upgrade the schema (what `zoo init` does)."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def head_revision(url: str) -> str | None:
    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def current_revision(url: str) -> str | None:
    with make_engine(url).connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def require_schema(url: str) -> None:
    """Refuse to work on a database that `zoo init` has not brought to the current schema."""
    current, head = current_revision(url), head_revision(url)
    if current != head:
        state = "not initialized" if current is None else f"at schema {current}, this zoo needs {head}"
        raise ZooError(f"database {shown_url(url)} is {state}: run `zoo init`")
