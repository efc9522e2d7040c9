"""search text: a document per adapter under a full-text index (PostgreSQL: generated tsvector, GIN; SQLite: FTS5); created_at index

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 18:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import TSVECTOR

from zoo.db.catalog import refresh_search_text

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: SQLite: the FTS5 index reads its text from adapter_text (external content) and these triggers keep it
#: in step with every insert, update and delete there, cascades from adapter included. The documents
#: are already lower-case words separated by spaces (zoo/db/catalog.py); the `ascii` tokenizer splits
#: them at the spaces only (it keeps every non-ASCII character in its word), so FTS5 sees the same
#: words as PostgreSQL and as the query builder.
SQLITE_FTS = (
    "CREATE VIRTUAL TABLE adapter_text_fts USING fts5(document, content='adapter_text', content_rowid='adapter_id', tokenize='ascii')",
    "CREATE TRIGGER adapter_text_ai AFTER INSERT ON adapter_text BEGIN "
    "INSERT INTO adapter_text_fts(rowid, document) VALUES (new.adapter_id, new.document); END",
    "CREATE TRIGGER adapter_text_ad AFTER DELETE ON adapter_text BEGIN "
    "INSERT INTO adapter_text_fts(adapter_text_fts, rowid, document) VALUES ('delete', old.adapter_id, old.document); END",
    "CREATE TRIGGER adapter_text_au AFTER UPDATE ON adapter_text BEGIN "
    "INSERT INTO adapter_text_fts(adapter_text_fts, rowid, document) VALUES ('delete', old.adapter_id, old.document); "
    "INSERT INTO adapter_text_fts(rowid, document) VALUES (new.adapter_id, new.document); END",
)


def upgrade() -> None:
    bind = op.get_bind()
    postgresql = bind.dialect.name == "postgresql"
    # PostgreSQL: the tsvector is a stored generated column, so that matching (phrases are rechecked
    # against it) and ts_rank read it instead of parsing every matching document again
    tsv = [sa.Column("document_tsv", TSVECTOR(), sa.Computed("to_tsvector('simple'::regconfig, document)", persisted=True))]
    op.create_table(
        "adapter_text",
        sa.Column("adapter_id", sa.Integer(), nullable=False),
        sa.Column("document", sa.Text(), nullable=False),
        *(tsv if postgresql else []),
        sa.ForeignKeyConstraint(["adapter_id"], ["adapter.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("adapter_id"),
    )
    if postgresql:
        op.create_index("ix_adapter_text_document_tsv", "adapter_text", ["document_tsv"], postgresql_using="gin")
    else:
        for statement in SQLITE_FTS:
            op.execute(statement)
    op.create_index("ix_adapter_created_at", "adapter", ["created_at"])  # the catalog's default order: newest first
    refresh_search_text(bind, bind.scalars(sa.text("SELECT id FROM adapter")).all(), source_fields=False)


def downgrade() -> None:
    op.drop_index("ix_adapter_created_at", table_name="adapter")
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_adapter_text_document_tsv", table_name="adapter_text")
    else:
        for trigger in ("adapter_text_ai", "adapter_text_ad", "adapter_text_au"):
            op.execute(f"DROP TRIGGER {trigger}")
        op.execute("DROP TABLE adapter_text_fts")
    op.drop_table("adapter_text")
