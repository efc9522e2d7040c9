"""Hub sources (author, source metadata, version links), job item leases and stage timings, and the
near-duplicate look-up's composite index

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23 22:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("adapter") as batch:
        batch.add_column(sa.Column("author", sa.String(128)))
        batch.add_column(sa.Column("source_metadata", sa.JSON(), nullable=False, server_default="{}"))
        batch.add_column(sa.Column("previous_version_id", sa.Integer()))
        batch.create_foreign_key("fk_adapter_previous_version_id_adapter", "adapter", ["previous_version_id"], ["id"], ondelete="SET NULL")
        batch.create_index("ix_adapter_author", ["author"])
        batch.create_index("ix_adapter_source_uri", ["source_uri"])
        batch.create_index("ix_adapter_base_model_structure_hash_dw_norm", ["base_model", "structure_hash", "dw_norm"])
    with op.batch_alter_table("job_item") as batch:
        batch.add_column(sa.Column("lease_owner", sa.String(128)))
        batch.add_column(sa.Column("lease_expires_at", sa.DateTime(timezone=True)))
        batch.add_column(sa.Column("started_at", sa.DateTime(timezone=True)))
        batch.add_column(sa.Column("timings", sa.JSON()))
        batch.create_index("ix_job_item_state_lease_expires_at", ["state", "lease_expires_at"])


def downgrade() -> None:
    with op.batch_alter_table("job_item") as batch:
        batch.drop_index("ix_job_item_state_lease_expires_at")
        batch.drop_column("timings")
        batch.drop_column("started_at")
        batch.drop_column("lease_expires_at")
        batch.drop_column("lease_owner")
    with op.batch_alter_table("adapter") as batch:
        batch.drop_index("ix_adapter_base_model_structure_hash_dw_norm")
        batch.drop_index("ix_adapter_source_uri")
        batch.drop_index("ix_adapter_author")
        batch.drop_constraint("fk_adapter_previous_version_id_adapter", type_="foreignkey")
        batch.drop_column("previous_version_id")
        batch.drop_column("source_metadata")
        batch.drop_column("author")
