"""embedding versions (the query engine learns of new embeddings from them), label value index

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 13:10:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("embedding_space", sa.Column("version", sa.BigInteger(), server_default="0", nullable=False))
    op.add_column("embedding", sa.Column("version", sa.BigInteger(), server_default="0", nullable=False))
    op.create_index("ix_embedding_embedder_id_version", "embedding", ["embedder_id", "version"])
    # label filters are equality look-ups: a hash index on PostgreSQL (no size limit on values), a
    # covering index on SQLite (its rows sit among embedding blobs: reading them is the slow part)
    if op.get_bind().dialect.name == "postgresql":
        op.create_index("ix_label_value", "label", ["value"], postgresql_using="hash")
    else:
        op.create_index("ix_label_key_value", "label", ["key", "value", "source", "adapter_id"])


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_label_value", table_name="label")
    else:
        op.drop_index("ix_label_key_value", table_name="label")
    op.drop_index("ix_embedding_embedder_id_version", table_name="embedding")
    op.drop_column("embedding", "version")
    op.drop_column("embedding_space", "version")
