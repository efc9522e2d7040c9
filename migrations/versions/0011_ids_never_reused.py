"""Adapter and label ids are never handed out twice on SQLite either: both tables become AUTOINCREMENT (SQLite
otherwise gives a new row the largest rowid + 1, so deleting the newest adapter gave its id, and every file and
cache keyed by it, to the next one ingested; deleting a key's newest label gave its id to the label replacing it,
which the engine's label mark then missed). PostgreSQL's serial ids never come back: nothing to do there.

Ids deleted before this migration stay spent as far as the tombstones (deleted_adapter) remember them: the
adapter sequence starts above the largest tombstoned id.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-30 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("adapter", "label")


def _rebuild(autoincrement: bool) -> None:
    for table in TABLES:  # a copy of the table with the flag, its rows, indexes and keys (foreign keys are off: env.py)
        with op.batch_alter_table(table, recreate="always", table_kwargs={"sqlite_autoincrement": autoincrement}):
            pass


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    _rebuild(True)
    # the copy set each sequence to the table's largest id; the adapter one also passes every tombstoned id
    for table in TABLES:
        missing = f"NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = '{table}')"
        op.execute(f"INSERT INTO sqlite_sequence (name, seq) SELECT '{table}', 0 WHERE {missing}")
    op.execute(
        "UPDATE sqlite_sequence SET seq = max(seq, (SELECT coalesce(max(adapter_id), 0) FROM deleted_adapter)) WHERE name = 'adapter'"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    _rebuild(False)
    for table in TABLES:
        op.execute(f"DELETE FROM sqlite_sequence WHERE name = '{table}'")
