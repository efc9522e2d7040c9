"""adapter.head_blob and module.kernel: what an export needs that the canonical factors do not hold, kept at ingest. A
PEFT adapter's tensors that are not LoRA factors (its head: modules_to_save, ...) go to a blob of their own, named by
its SHA-256 like the factors' blob; a conv module's kernel, (in_channels, k...), whose product is the stored
in_features. Adapters stored before keep None (an export reads them from the source file where it is as ingested).

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-28 22:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("adapter", sa.Column("head_blob", sa.String(length=64)))
    op.add_column("module", sa.Column("kernel", sa.JSON()))


def downgrade() -> None:
    with op.batch_alter_table("module") as batch:
        batch.drop_column("kernel")
    with op.batch_alter_table("adapter") as batch:
        batch.drop_column("head_blob")
