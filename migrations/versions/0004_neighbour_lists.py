"""neighbour lists: each adapter's nearest neighbours by module cosine, for contextual search

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 06:11:46.670198
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "neighbour_list",
        sa.Column("adapter_id", sa.Integer(), nullable=False),
        sa.Column("space_id", sa.Integer(), nullable=False),
        sa.Column("neighbours", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.ForeignKeyConstraint(["adapter_id"], ["adapter.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["space_id"], ["embedding_space.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("adapter_id"),
    )
    with op.batch_alter_table("neighbour_list", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_neighbour_list_space_id"), ["space_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("neighbour_list", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_neighbour_list_space_id"))

    op.drop_table("neighbour_list")
