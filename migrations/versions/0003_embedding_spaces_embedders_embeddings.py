"""embedding spaces, embedders, embeddings

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 04:13:47.955691
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "embedding_space",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("base_model", sa.String(length=255), nullable=False),
        sa.Column("schema", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    with op.batch_alter_table("embedding_space", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_embedding_space_base_model"), ["base_model"], unique=False)

    op.create_table(
        "embedder",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("space_id", sa.Integer(), nullable=False),
        sa.Column("method", sa.String(length=32), nullable=False),
        sa.Column("objective", sa.String(length=32), nullable=True),
        sa.Column("checkpoint", sa.Text(), nullable=True),
        sa.Column("dim", sa.Integer(), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.ForeignKeyConstraint(["space_id"], ["embedding_space.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("embedder", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_embedder_space_id"), ["space_id"], unique=False)

    op.create_table(
        "embedding",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("adapter_id", sa.Integer(), nullable=False),
        sa.Column("embedder_id", sa.Integer(), nullable=False),
        sa.Column("vector", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["adapter_id"], ["adapter.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["embedder_id"], ["embedder.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("adapter_id", "embedder_id", name="uq_embedding_adapter_id_embedder_id"),
    )
    with op.batch_alter_table("embedding", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_embedding_adapter_id"), ["adapter_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_embedding_embedder_id"), ["embedder_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("embedding", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_embedding_embedder_id"))
        batch_op.drop_index(batch_op.f("ix_embedding_adapter_id"))

    op.drop_table("embedding")
    with op.batch_alter_table("embedder", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_embedder_space_id"))

    op.drop_table("embedder")
    with op.batch_alter_table("embedding_space", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_embedding_space_base_model"))

    op.drop_table("embedding_space")
