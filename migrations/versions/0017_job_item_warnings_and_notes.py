"""job_item.warnings and job_item.notes: what ingest said of an item's source besides its outcome (a base model its
module shapes contradict; the base model guessed from them), kept with the item as `zoo ingest` prints it. Items
finished before keep None (nothing was said, or it was lost).

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-29 00:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("job_item", sa.Column("warnings", sa.JSON()))
    op.add_column("job_item", sa.Column("notes", sa.JSON()))


def downgrade() -> None:
    with op.batch_alter_table("job_item") as batch:
        batch.drop_column("notes")
        batch.drop_column("warnings")
