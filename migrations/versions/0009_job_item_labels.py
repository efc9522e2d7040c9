"""Labels per job item: `zoo ingest --ray --labels` and `zoo jobs add --labels` carry each source's
CSV row to whichever worker ingests it

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24 04:10:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("job_item", sa.Column("labels", sa.JSON()))


def downgrade() -> None:
    with op.batch_alter_table("job_item") as batch:
        batch.drop_column("labels")
