"""Relations found from the weights (issue 33): `adapter_relation`, one row per edge (a merge, one per parent), and
`relation_scan`, which adapters the relation step has scanned with which detector version. Both cascade from adapter:
no edge or scan outlives either of its adapters.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "adapter_relation",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("child_id", sa.Integer(), sa.ForeignKey("adapter.id", ondelete="CASCADE"), nullable=False),
        sa.Column("parent_id", sa.Integer(), sa.ForeignKey("adapter.id", ondelete="CASCADE"), nullable=False),
        sa.Column("relation", sa.String(length=16), nullable=False),
        sa.Column("parameters", sa.JSON(), nullable=False),
        sa.Column("evidence", sa.JSON(), nullable=False),
        sa.Column("confidence", sa.Float(), nullable=False),
        sa.Column("detector", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.UniqueConstraint("child_id", "parent_id", "relation", name="uq_adapter_relation_child_id_parent_id_relation"),
    )
    op.create_index("ix_adapter_relation_parent_id_relation", "adapter_relation", ["parent_id", "relation"])
    op.create_index("ix_adapter_relation_relation_child_id", "adapter_relation", ["relation", "child_id"])
    op.create_table(
        "relation_scan",
        sa.Column("adapter_id", sa.Integer(), sa.ForeignKey("adapter.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("detector", sa.String(length=32), nullable=False),
        sa.Column("space_version", sa.BigInteger(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("scanned_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("relation_scan")
    op.drop_index("ix_adapter_relation_relation_child_id", table_name="adapter_relation")
    op.drop_index("ix_adapter_relation_parent_id_relation", table_name="adapter_relation")
    op.drop_table("adapter_relation")
