"""labels and measurements

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 03:28:53.177728
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "label",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("adapter_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=128), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.Column("source", sa.String(length=16), nullable=False),
        sa.Column("model_version", sa.String(length=64), nullable=True),
        sa.ForeignKeyConstraint(["adapter_id"], ["adapter.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("adapter_id", "key", "source", name="uq_label_adapter_id_key_source"),
    )
    with op.batch_alter_table("label", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_label_adapter_id"), ["adapter_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_label_key"), ["key"], unique=False)

    op.create_table(
        "measurement",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("adapter_id", sa.Integer(), nullable=False),
        sa.Column("metric", sa.String(length=128), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("split", sa.String(length=32), nullable=False),
        sa.ForeignKeyConstraint(["adapter_id"], ["adapter.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("adapter_id", "metric", "split", name="uq_measurement_adapter_id_metric_split"),
    )
    with op.batch_alter_table("measurement", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_measurement_adapter_id"), ["adapter_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_measurement_metric"), ["metric"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("measurement", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_measurement_metric"))
        batch_op.drop_index(batch_op.f("ix_measurement_adapter_id"))

    op.drop_table("measurement")
    with op.batch_alter_table("label", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_label_key"))
        batch_op.drop_index(batch_op.f("ix_label_adapter_id"))

    op.drop_table("label")
