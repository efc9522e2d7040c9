"""deleted adapters (tombstones stamped with their space's version)

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 21:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "deleted_adapter",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("adapter_id", sa.Integer(), nullable=False),
        sa.Column("space_id", sa.Integer(), sa.ForeignKey("embedding_space.id", ondelete="CASCADE"), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    )
    op.create_index("ix_deleted_adapter_space_id_version", "deleted_adapter", ["space_id", "version"])


def downgrade() -> None:
    op.drop_index("ix_deleted_adapter_space_id_version", table_name="deleted_adapter")
    op.drop_table("deleted_adapter")
