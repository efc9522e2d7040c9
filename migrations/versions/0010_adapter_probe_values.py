"""Each adapter's raw probe values (dw_probes), so that the near-duplicate check reads a candidate's
factors only when they may be within the tolerance; adapters stored before have none (their factors
are read, as before)

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("adapter", sa.Column("dw_probes", sa.JSON()))


def downgrade() -> None:
    with op.batch_alter_table("adapter") as batch:
        batch.drop_column("dw_probes")
