"""relation_scan.read_budget: the read budget (ZOO_EMBED_CHUNK_BYTES) under which a scan compared an adapter with fewer
neighbours than the relation step compares, so that a later step with a larger budget scans it again. Scans stored
before keep None (not cut, as far as is known).

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-30 02:50:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("relation_scan", sa.Column("read_budget", sa.BigInteger()))


def downgrade() -> None:
    with op.batch_alter_table("relation_scan") as batch:
        batch.drop_column("read_budget")
