"""api_token.scope: what a token may do (read, write: ingest and labels, admin: delete and tokens). Tokens made before
could do everything, so they become admin; a new token's scope is chosen when it is made (zoo.store.tokens).

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28 18:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # the server default fills the rows there are (the rights they had in effect), then goes: a new row names its scope
    op.add_column("api_token", sa.Column("scope", sa.String(8), nullable=False, server_default="admin"))
    with op.batch_alter_table("api_token") as batch:
        batch.alter_column("scope", server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("api_token") as batch:
        batch.drop_column("scope")
