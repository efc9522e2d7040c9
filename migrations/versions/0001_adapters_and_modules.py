"""adapters and modules

Revision ID: 0001
Revises:
Create Date: 2026-11-22 03:16:03.289097
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "adapter",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("source_uri", sa.Text(), nullable=False),
        sa.Column("source_revision", sa.String(length=64), nullable=True),
        sa.Column("base_model", sa.String(length=255), nullable=False),
        sa.Column("format", sa.String(length=32), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("alpha", sa.Float(), nullable=True),
        sa.Column("target_modules", sa.JSON(), nullable=True),
        sa.Column("task_type", sa.String(length=64), nullable=True),
        sa.Column("canonical_hash", sa.String(length=64), nullable=False),
        sa.Column("structure_hash", sa.String(length=64), nullable=False),
        sa.Column("dw_norm", sa.Float(), nullable=True),
        sa.Column("file_sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("factors_blob", sa.String(length=64), nullable=True),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("file_metadata", sa.JSON(), nullable=False),
        sa.Column("extra_tensors", sa.JSON(), nullable=False),
        sa.Column("notes", sa.JSON(), nullable=False),
        sa.Column("license", sa.String(length=128), nullable=True),
        sa.Column("tags", sa.JSON(), nullable=True),
        sa.Column("card", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("base_model", "canonical_hash", name="uq_adapter_base_model_canonical_hash"),
    )
    op.create_index(op.f("ix_adapter_base_model"), "adapter", ["base_model"], unique=False)
    op.create_index(op.f("ix_adapter_dw_norm"), "adapter", ["dw_norm"], unique=False)
    op.create_index(op.f("ix_adapter_file_sha256"), "adapter", ["file_sha256"], unique=False)
    op.create_index(op.f("ix_adapter_structure_hash"), "adapter", ["structure_hash"], unique=False)
    op.create_table(
        "module",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("adapter_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=512), nullable=False),
        sa.Column("layer_index", sa.Integer(), nullable=True),
        sa.Column("module_type", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("out_features", sa.Integer(), nullable=False),
        sa.Column("in_features", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("canonical_rank", sa.Integer(), nullable=True),
        sa.Column("alpha", sa.Float(), nullable=True),
        sa.Column("scale", sa.Float(), nullable=True),
        sa.Column("transposed", sa.Boolean(), nullable=False),
        sa.Column("singular_values", sa.JSON(), nullable=False),
        sa.Column("spectral_norm", sa.Float(), nullable=False),
        sa.Column("frobenius_norm", sa.Float(), nullable=False),
        sa.Column("stable_rank", sa.Float(), nullable=False),
        sa.Column("effective_rank", sa.Float(), nullable=False),
        sa.Column("power_law_alpha", sa.Float(), nullable=True),
        sa.Column("power_law_xmin", sa.Float(), nullable=True),
        sa.Column("power_law_ks", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["adapter_id"], ["adapter.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("adapter_id", "name", name="uq_module_adapter_id_name"),
    )
    op.create_index(op.f("ix_module_adapter_id"), "module", ["adapter_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_module_adapter_id"), table_name="module")
    op.drop_table("module")
    op.drop_index(op.f("ix_adapter_structure_hash"), table_name="adapter")
    op.drop_index(op.f("ix_adapter_file_sha256"), table_name="adapter")
    op.drop_index(op.f("ix_adapter_dw_norm"), table_name="adapter")
    op.drop_index(op.f("ix_adapter_base_model"), table_name="adapter")
    op.drop_table("adapter")
