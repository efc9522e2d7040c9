"""A pattern index on adapter.source_uri (PostgreSQL): the catalog's `source` filter is a prefix, LIKE 'prefix%',
which a plain btree serves only under the C collation; without it a source filter read the whole table (185 ms at a
million adapters), and it is often the narrowest filter the catalog's facets read their candidates through. SQLite's
LIKE ignores case and uses no index: nothing to do there.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.create_index("ix_adapter_source_uri_prefix", "adapter", ["source_uri"], postgresql_ops={"source_uri": "text_pattern_ops"})


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_adapter_source_uri_prefix", table_name="adapter")
