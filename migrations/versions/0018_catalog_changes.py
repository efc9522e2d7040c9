"""catalog_change: a change to the catalog's texts that leaves no newer row behind (a given label removed alone, an
adapter deleted), one row each, ids only growing, so that an index of the texts (the dense text index) sees it in the
catalog's mark (zoo.store.text_rows.catalog_mark) instead of at the next write.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-29 06:50:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "catalog_change",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("adapter_id", sa.Integer(), nullable=False),
        sa.Column("what", sa.String(32), nullable=False),
        sa.Column("changed_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sqlite_autoincrement=True,
    )


def downgrade() -> None:
    op.drop_table("catalog_change")
