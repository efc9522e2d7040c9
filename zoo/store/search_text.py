"""Search words and documents: what the catalog's full-text index holds (zoo/store/catalog.py searches it).

Search words are the letters-and-digits runs of a text after Unicode compatibility decomposition,
without accents, case-folded (`digits-vit-00012` is `digits vit 00012`, `task=even` is `task even`).
A document is the search words of an adapter's name, base model, format, given labels (each as
`key value`), tags, what its source said (`author A`, `dataset D` for each of the card's datasets,
`pipeline_tag P`), source URI and model card, joined by spaces: PostgreSQL's `simple` parser and
SQLite's FTS5 `ascii` tokenizer split it at the spaces only, so both databases index the same words.

A query's words (split at white space) are AND-ed; a word of several search words is a phrase (so
`task=even` finds the label, `digits-vit-00012` the name) and the last word's last search word
matches as a prefix. Queries are built from search words only, so no user text is ever query syntax.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import (
    ColumnClause,
    ColumnElement,
    Connection,
    String,
    delete,
    exists,
    false,
    func,
    insert,
    literal,
    literal_column,
    select,
    text,
)
from sqlalchemy.orm import Session

from zoo.store.models import SQLITE_FTS_TABLE, Adapter, AdapterText, Label

#: a query's words past this many are ignored (FTS5 and tsquery expressions stay small)
MAX_QUERY_WORDS = 32
#: search words are cut to this many characters, in documents and queries alike
MAX_WORD_CHARS = 64
#: model-card characters indexed (a tsvector holds at most 1 MB)
MAX_CARD_CHARS = 100_000
#: adapters whose documents are written per statement
REFRESH_BATCH = 500

_WORD = re.compile(r"[^\W_]+")
_SIMPLE: ColumnClause[Any] = literal_column("'simple'::regconfig")
_TEXT = AdapterText.__table__


def search_words(text: str) -> list[str]:
    """The search words of a text: letters-and-digits runs, accents dropped, case-folded, cut to MAX_WORD_CHARS."""
    decomposed = unicodedata.normalize("NFKD", text)
    folded = "".join(c for c in decomposed if not unicodedata.combining(c)).casefold()
    return [w[:MAX_WORD_CHARS] for w in _WORD.findall(folded)]


def search_document(
    name: str,
    base_model: str,
    fmt: str,
    source_uri: str,
    tags: object,
    card: str | None,
    labels: Mapping[str, str],
    author: str | None = None,
    source_metadata: object = None,
) -> str:
    """An adapter's search document: the search words of its text fields, given labels and what its source said
    (author, the card's datasets, pipeline tag), space-separated."""
    fields = [name, base_model, fmt, *(f"{k} {v}" for k, v in sorted(labels.items()))]
    fields += [str(t) for t in tags] if isinstance(tags, list) else []
    meta = source_metadata if isinstance(source_metadata, dict) else {}
    datasets = meta.get("datasets")
    fields += [f"author {author}"] if author else []
    fields += [f"dataset {d}" for d in datasets if isinstance(d, str)] if isinstance(datasets, list) else []
    fields += [f"pipeline_tag {meta['pipeline_tag']}"] if isinstance(meta.get("pipeline_tag"), str) else []
    fields += [source_uri, (card or "")[:MAX_CARD_CHARS]]
    return " ".join(search_words(" ".join(fields)))


_DOCUMENT_FIELDS = (Adapter.id, Adapter.name, Adapter.base_model, Adapter.format, Adapter.source_uri, Adapter.tags, Adapter.card)
#: what the source said (columns added by migration 0008)
_SOURCE_DOCUMENT_FIELDS = (Adapter.author, Adapter.source_metadata)


def refresh_search_text(db: Session | Connection, adapter_ids: Iterable[int]) -> None:
    """(Re)write the search documents of these adapters from their rows and given labels. Call it in the
    transaction that writes the adapter or its labels (migration 0005's backfill is its own frozen copy)."""
    fields = select(*_DOCUMENT_FIELDS, *_SOURCE_DOCUMENT_FIELDS)
    ids = sorted(set(adapter_ids))
    for start in range(0, len(ids), REFRESH_BATCH):
        chunk = ids[start : start + REFRESH_BATCH]
        labels: dict[int, dict[str, str]] = {}
        given = select(Label.adapter_id, Label.key, Label.value).where(Label.adapter_id.in_(chunk), Label.source == "given")
        for adapter_id, key, value in db.execute(given):
            labels.setdefault(adapter_id, {})[key] = value
        rows = [
            {
                "adapter_id": r.id,
                "document": search_document(
                    r.name, r.base_model, r.format, r.source_uri, r.tags, r.card, labels.get(r.id, {}), *r[len(_DOCUMENT_FIELDS) :]
                ),
            }
            for r in db.execute(fields.where(Adapter.id.in_(chunk)))
        ]
        db.execute(delete(_TEXT).where(_TEXT.c.adapter_id.in_(chunk)))
        if rows:
            db.execute(insert(_TEXT), rows)


def write_search_text(db: Session | Connection, adapter: Adapter, labels: Mapping[str, str]) -> None:
    """Write the search document of an adapter inserted in this transaction from its row in memory and its given
    labels, reading nothing back (refresh_search_text rewrites the documents of stored adapters)."""
    a = adapter
    document = search_document(a.name, a.base_model, a.format, a.source_uri, a.tags, a.card, labels, a.author, a.source_metadata)
    db.execute(insert(_TEXT), {"adapter_id": a.id, "document": document})


def query_phrases(q: str | None) -> list[list[str]]:
    """A query's words (split at white space) as lists of search words; words without any are dropped."""
    phrases = [words for words in map(search_words, (q or "").split()) if words]
    return phrases[:MAX_QUERY_WORDS]


def tsquery_text(phrases: list[list[str]], prefix: bool = True) -> str:
    """PostgreSQL `to_tsquery` text: phrases (`<->`) AND-ed, the last search word a prefix (`:*`) unless `prefix` is false."""
    quoted = [[f"'{w}'" for w in words] for words in phrases]
    if prefix:
        quoted[-1][-1] += ":*"
    return " & ".join("(" + " <-> ".join(words) + ")" for words in quoted)


def fts5_query_text(phrases: list[list[str]]) -> str:
    """SQLite FTS5 MATCH text: quoted phrases AND-ed, the last one's last word a prefix (`*`)."""
    quoted = ['"' + " ".join(words) + '"' for words in phrases]
    quoted[-1] += " *"
    return " AND ".join(quoted)


def as_tsquery(phrases: list[list[str]], inline: bool = False, prefix: bool = True) -> ColumnElement[Any]:
    """The phrases as a PostgreSQL tsquery (`prefix`: see tsquery_text); `inline`: its text written into the statement,
    so that each query is planned for its own words (a prepared statement's generic plan, made after five runs, reads
    every match of a word all adapters have: 6 ms became 50)."""
    words = tsquery_text(phrases, prefix)
    return func.to_tsquery(_SIMPLE, literal(words, String, literal_execute=True) if inline else words)


#: a query whose last search word (matched as a prefix) has at most this many characters looks each of its other search
#: words up alone first: the query matches nothing when one of them is in no document, and so short a prefix is what
#: costs (`7` reads every number that begins with 7 in a million adapters' text index: PostgreSQL 37 ms, SQLite 145 ms,
#: though `film` is in no document)
SHORT_PREFIX_CHARS = 2


def other_words_found(session: Session, phrases: list[list[str]]) -> list[ColumnElement[bool]]:
    """Conditions of a query's text search that each search word but the last (the prefix) is in some document, where
    that prefix is short (SHORT_PREFIX_CHARS; none where it is longer). PostgreSQL evaluates them once, before the text
    search, and skips the search when one is false (a one-time filter); a word at a time, so that each is read by its
    own frequency (the index for a rare word, the table's first rows for a common one). SQLite runs its full-text search
    before any such condition: the words are looked up here, and a false condition (the search skipped) stands for one
    in no document."""
    last = phrases[-1][-1]
    if len(last) > SHORT_PREFIX_CHARS:
        return []
    others = [w for w in dict.fromkeys(w for phrase in phrases for w in phrase) if w != last]
    if session.get_bind().dialect.name == "postgresql":
        return [exists().where(AdapterText.document_tsv.bool_op("@@")(as_tsquery([[w]], inline=True, prefix=False))) for w in others]
    lookup = text(f"SELECT EXISTS (SELECT 1 FROM {SQLITE_FTS_TABLE} WHERE {SQLITE_FTS_TABLE} MATCH :word)")
    return [] if all(session.execute(lookup, {"word": f'"{w}"'}).scalar() for w in others) else [false()]
