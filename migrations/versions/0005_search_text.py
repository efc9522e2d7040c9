"""search text: a document per adapter under a full-text index (PostgreSQL: generated tsvector, GIN; SQLite: FTS5); created_at index

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 18:00:00.000000
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import TSVECTOR

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: SQLite: the FTS5 index reads its text from adapter_text (external content) and these triggers keep it
#: in step with every insert, update and delete there, cascades from adapter included. The documents
#: are already lower-case words separated by spaces (zoo/store/catalog.py); the `ascii` tokenizer splits
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


#: The backfill below is a frozen copy of zoo/store/catalog.py's search document as it was at this revision (issue 31:
#: a migration imports nothing live, so it never changes when live code does), over the tables as they were then.
_ADAPTER = sa.table(
    "adapter",
    sa.column("id", sa.Integer()),
    sa.column("name", sa.String()),
    sa.column("base_model", sa.String()),
    sa.column("format", sa.String()),
    sa.column("source_uri", sa.Text()),
    sa.column("tags", sa.JSON()),
    sa.column("card", sa.Text()),
)
_LABEL = sa.table(
    "label",
    sa.column("adapter_id", sa.Integer()),
    sa.column("key", sa.String()),
    sa.column("value", sa.Text()),
    sa.column("source", sa.String()),
)
_TEXT = sa.table("adapter_text", sa.column("adapter_id", sa.Integer()), sa.column("document", sa.Text()))
_WORD = re.compile(r"[^\W_]+")
_MAX_WORD_CHARS = 64
_MAX_CARD_CHARS = 100_000
_BATCH = 500


def _search_words(text: str) -> list[str]:
    """Letters-and-digits runs, accents dropped, case-folded, cut to _MAX_WORD_CHARS."""
    decomposed = unicodedata.normalize("NFKD", text)
    folded = "".join(c for c in decomposed if not unicodedata.combining(c)).casefold()
    return [w[:_MAX_WORD_CHARS] for w in _WORD.findall(folded)]


def _search_document(name: str, base_model: str, fmt: str, source_uri: str, tags: object, card: str | None, labels: dict[str, str]) -> str:
    """The search words of an adapter's name, base model, format, given labels, tags, source URI and card."""
    fields = [name, base_model, fmt, *(f"{k} {v}" for k, v in sorted(labels.items()))]
    fields += [str(t) for t in tags] if isinstance(tags, list) else []
    fields += [source_uri, (card or "")[:_MAX_CARD_CHARS]]
    return " ".join(_search_words(" ".join(fields)))


def _backfill_search_text(bind: sa.Connection) -> None:
    """Write the search document of every stored adapter from its row and given labels."""
    ids = sorted(bind.scalars(sa.select(_ADAPTER.c.id)).all())
    for start in range(0, len(ids), _BATCH):
        chunk = ids[start : start + _BATCH]
        labels: dict[int, dict[str, str]] = {}
        given = sa.select(_LABEL.c.adapter_id, _LABEL.c.key, _LABEL.c.value).where(
            _LABEL.c.adapter_id.in_(chunk), _LABEL.c.source == "given"
        )
        for adapter_id, key, value in bind.execute(given):
            labels.setdefault(adapter_id, {})[key] = value
        fields = sa.select(
            _ADAPTER.c.id,
            _ADAPTER.c.name,
            _ADAPTER.c.base_model,
            _ADAPTER.c.format,
            _ADAPTER.c.source_uri,
            _ADAPTER.c.tags,
            _ADAPTER.c.card,
        )
        rows = [
            {
                "adapter_id": r.id,
                "document": _search_document(r.name, r.base_model, r.format, r.source_uri, r.tags, r.card, labels.get(r.id, {})),
            }
            for r in bind.execute(fields.where(_ADAPTER.c.id.in_(chunk)))
        ]
        if rows:
            bind.execute(sa.insert(_TEXT), rows)


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
    _backfill_search_text(bind)


def downgrade() -> None:
    op.drop_index("ix_adapter_created_at", table_name="adapter")
    if op.get_bind().dialect.name == "postgresql":
        op.drop_index("ix_adapter_text_document_tsv", table_name="adapter_text")
    else:
        for trigger in ("adapter_text_ai", "adapter_text_ad", "adapter_text_au"):
            op.execute(f"DROP TRIGGER {trigger}")
        op.execute("DROP TABLE adapter_text_fts")
    op.drop_table("adapter_text")
