"""API tokens (stored hashed) and ingestion jobs with a state per item

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 20:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_token",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("token_sha256", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True)),
        sa.Column("revoked_at", sa.DateTime(timezone=True)),
        sa.UniqueConstraint("token_sha256", name="uq_api_token_token_sha256"),
    )
    op.create_table(
        "job",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("created_by", sa.String(128)),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
    )
    op.create_index("ix_job_state", "job", ["state"])
    op.create_table(
        "job_item",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("job.id", ondelete="CASCADE"), nullable=False),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text()),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("adapter_id", sa.Integer(), sa.ForeignKey("adapter.id", ondelete="SET NULL")),
        sa.Column("updated_at", sa.DateTime(timezone=True)),
    )
    op.create_index("ix_job_item_job_id_state", "job_item", ["job_id", "state"])


def downgrade() -> None:
    op.drop_index("ix_job_item_job_id_state", table_name="job_item")
    op.drop_table("job_item")
    op.drop_index("ix_job_state", table_name="job")
    op.drop_table("job")
    op.drop_table("api_token")
