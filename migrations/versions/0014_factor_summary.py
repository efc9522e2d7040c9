"""adapter.factor_summary: what the relation step needs of an adapter's factors as read from its file, which are not
kept (zoo.domain.transforms.FactorSummary: the precisions that hold every entry, the exact zeros and the residual their
pruning predicts). Without it a magnitude-pruned copy is not recognized; adapters stored before keep None.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03 09:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("adapter", sa.Column("factor_summary", sa.JSON()))


def downgrade() -> None:
    with op.batch_alter_table("adapter") as batch:
        batch.drop_column("factor_summary")
