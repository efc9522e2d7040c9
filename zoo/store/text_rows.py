"""What the dense text index (embed/serving/text_search.py) reads from the database: each adapter's text as a sentence encoder
takes it, the mark that says whether an index file is still current, and the supervised W2T embedders whose
predictions it embeds."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from zoo.store.models import Adapter, CatalogChange, Embedder, EmbeddingSpace, Label

#: model-card characters put in a document (the encoder reads its first 256 tokens anyway)
CARD_CHARS = 2_000
#: adapters read per statement
BATCH = 5_000


@dataclass(frozen=True)
class AdapterText:
    """One adapter's text: its document (name, given labels, tags, author, card), its given labels, its name without
    numbers, and whether it has text beside its name."""

    adapter_id: int
    base_model: str
    document: str
    given: dict[str, str]
    stem: str
    described: bool


def catalog_mark(session: Session) -> dict[str, int]:
    """What an index of the catalog's texts covers: the last adapter, label row and catalog change (three index reads).
    Label rows are inserted for every new value, a card changes only by a new ingest, and a label removed alone or an
    adapter deleted leaves a CatalogChange row, so an index whose mark equals this one is current."""
    conn = session.connection()
    return {
        "adapter": int(conn.execute(select(func.max(Adapter.id))).scalar() or 0),
        "label": int(conn.execute(select(func.max(Label.id))).scalar() or 0),
        "change": int(conn.execute(select(func.max(CatalogChange.id))).scalar() or 0),
    }


_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_NUMBERS = re.compile(r"\b\d+\b")


def words(text: str) -> str:
    """A name or value as words: `subset-even` is `subset even`."""
    return " ".join(text.replace("-", " ").replace("_", " ").replace("/", " ").split())


def name_stem(name: str) -> str:
    """A name without its numbers: `digits-vit-00012` is `digits vit` (what a zoo's numbered names share)."""
    return " ".join(_NUMBERS.sub(" ", words(name)).split())


def document_text(name: str, labels: dict[str, str], tags: object, author: str | None, card: str | None) -> str:
    """An adapter's document for the sentence encoder: its name without numbers, given labels as `key: value` (those
    of words: a seed or learning rate says nothing a sentence asks for), tags, author and the start of its card."""
    parts = [name_stem(name)]
    parts += [f"{words(k)}: {words(v)}" for k, v in sorted(labels.items()) if not _NUMBER.match(v.strip())]
    parts += [", ".join(str(t) for t in tags)] if isinstance(tags, list) and tags else []
    parts += [f"by {author}"] if author else []
    parts += [" ".join((card or "")[:CARD_CHARS].split())] if card else []
    return ". ".join(p for p in parts if p)


def adapter_texts(session: Session) -> Iterator[AdapterText]:
    """Every adapter's text, by id, a batch of BATCH adapters a statement."""
    conn = session.connection()
    last = 0
    while True:
        rows = conn.execute(
            select(Adapter.id, Adapter.name, Adapter.base_model, Adapter.tags, Adapter.author, Adapter.card)
            .where(Adapter.id > last)
            .order_by(Adapter.id)
            .limit(BATCH)
        ).all()
        if not rows:
            return
        ids = [r.id for r in rows]
        labels: dict[int, dict[str, str]] = {}
        given = select(Label.id, Label.adapter_id, Label.key, Label.value).where(Label.adapter_id.in_(ids), Label.source == "given")
        for _, adapter_id, key, value in sorted(conn.execute(given).all()):  # by label id: the newest value wins
            labels.setdefault(adapter_id, {})[key] = value
        for r in rows:
            own = labels.get(r.id, {})
            document = document_text(r.name, own, r.tags, r.author, r.card)
            stem = name_stem(r.name)
            yield AdapterText(r.id, r.base_model, document, own, stem, described=document != stem)
        last = ids[-1]


def adapter_ids(session: Session) -> list[int]:
    """Every adapter's id, in order (what an index of the texts must hold)."""
    return [int(i) for i in session.connection().execute(select(Adapter.id).order_by(Adapter.id)).scalars()]


def predictors(session: Session) -> dict[str, tuple[str, int]]:
    """{base model: (space name, embedder id)} of each space's newest active supervised W2T embedder (what
    `QueryEngine.predict` serves)."""
    stmt = (
        select(EmbeddingSpace.base_model, EmbeddingSpace.name, func.max(Embedder.id))
        .join(Embedder, Embedder.space_id == EmbeddingSpace.id)
        .where(Embedder.method == "w2t", Embedder.active.is_(True), func.coalesce(Embedder.objective, "") != "contrastive")
        .group_by(EmbeddingSpace.base_model, EmbeddingSpace.name)
    )
    return {base: (name, int(e)) for base, name, e in session.execute(stmt)}


def space_names(session: Session) -> dict[str, str]:
    """{base model: space name} of every space."""
    return {base: name for base, name in session.execute(select(EmbeddingSpace.base_model, EmbeddingSpace.name))}
