"""Relations found from the weights, as stored: one adapter's scan written (its edges and its scan row),
an adapter's edges read both ways, the catalog's relation filters, and the adapters still to scan. Every read is an
indexed look-up (by child, by parent and relation, by relation), so it costs the same in a zoo of a million.

Edges are written idempotently: a transform or continuation is one row per (child, parent, relation), updated when
found again; a merge is one row per parent, and a merge found again replaces the child's merge rows (its parents are
one finding). An adapter has one origin: a transform or merge that explains it leaves it no continuation parent, and
of its continuation parents it keeps the one it shares most with (`zoo.domain.continuation.origin_score`), whichever
scan found which first. A scan by
a new detector replaces the edges an older one stored around the adapter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict

from sqlalchemy import ColumnElement, Select, and_, delete, exists, insert, or_, select, update
from sqlalchemy.orm import Session

from zoo.errors import UsageError
from zoo.store.models import RELATIONS, Adapter, AdapterRelation, Embedding, RelationParameters, RelationScan
from zoo.timestamps import iso_seconds

#: edges listed each way on an adapter's lineage (the most confident first)
LISTED = 50
#: the card's `base_model_relation` that a relation found from the weights amounts to (the others have no card word)
CARD_WORDS = {"merge": "merge", "cast": "quantized", "continuation": "finetune"}


class EdgeRow(TypedDict):
    """One edge to store: `child` is `relation` of `parent`."""

    child_id: int
    parent_id: int
    relation: str
    parameters: RelationParameters
    evidence: dict[str, float | None]
    confidence: float


def write_scan(
    session: Session,
    adapter_id: int,
    edges: Sequence[EdgeRow],
    detector: str,
    space_version: int,
    error: str | None = None,
    read_budget: int | None = None,
) -> None:
    """Store one scan's edges and mark the adapter scanned by `detector` at `space_version` (with the error that
    stopped it, if any, and the `read_budget` that left some of its neighbours uncompared), in the caller's
    transaction. Merges replace their child's earlier merge rows; other edges are updated in place; a continuation
    is kept only as its child's one origin (the module docstring)."""
    touching = or_(AdapterRelation.child_id == adapter_id, AdapterRelation.parent_id == adapter_id)
    session.execute(delete(AdapterRelation).where(touching, AdapterRelation.detector != detector))
    merged = {e["child_id"] for e in edges if e["relation"] == "merge"}
    if merged:
        session.execute(delete(AdapterRelation).where(AdapterRelation.child_id.in_(merged), AdapterRelation.relation == "merge"))
    for e in sorted(edges, key=lambda e: e["relation"] == "continuation"):  # what explains a child before its continuations
        if e["relation"] == "continuation" and not _keep_continuation(session, e):
            continue
        if e["relation"] != "continuation":
            _drop_continuations(session, e["child_id"], e["parent_id"])
        values = {**e, "detector": detector}
        if e["relation"] == "merge" or _update(session, values) == 0:
            session.execute(insert(AdapterRelation), values)
    session.execute(delete(RelationScan).where(RelationScan.adapter_id == adapter_id))
    row = {"adapter_id": adapter_id, "detector": detector, "space_version": space_version, "error": error, "read_budget": read_budget}
    session.execute(insert(RelationScan), row)


def _keep_continuation(session: Session, e: EdgeRow) -> bool:
    """Whether a continuation is its child's origin: the child has no transform or merge parent, the pair no other
    edge either way, and no other continuation parent of the child has a higher origin score. The lower ones are
    deleted."""
    from zoo.domain.continuation import origin_score  # here: the detectors import torch, which reading edges never needs

    child, parent, score = e["child_id"], e["parent_id"], origin_score(e["evidence"])
    pair = or_(
        and_(AdapterRelation.child_id == child, AdapterRelation.parent_id == parent),
        and_(AdapterRelation.child_id == parent, AdapterRelation.parent_id == child),
    )
    if session.scalar(select(exists().where(or_(AdapterRelation.child_id == child, pair), AdapterRelation.relation != "continuation"))):
        return False
    others = select(AdapterRelation.id, AdapterRelation.evidence).where(
        AdapterRelation.child_id == child, AdapterRelation.relation == "continuation", AdapterRelation.parent_id != parent
    )
    rows = session.execute(others).all()
    if any(origin_score(ev or {}) >= score for _, ev in rows):
        return False
    if rows:
        session.execute(delete(AdapterRelation).where(AdapterRelation.id.in_([i for i, _ in rows])))
    return True


def _drop_continuations(session: Session, child: int, parent: int) -> None:
    """Delete the continuations that a transform or merge of `child` from `parent` explains: the child's, and the
    pair's either way."""
    pair = or_(AdapterRelation.child_id == child, and_(AdapterRelation.child_id == parent, AdapterRelation.parent_id == child))
    session.execute(delete(AdapterRelation).where(pair, AdapterRelation.relation == "continuation"))


def _update(session: Session, values: Mapping[str, Any]) -> int:
    """Rewrite the stored edge with this edge's key (child, parent, relation); the count of rows rewritten."""
    key = [getattr(AdapterRelation, c) == values[c] for c in ("child_id", "parent_id", "relation")]
    changed = {c: values[c] for c in ("parameters", "evidence", "confidence", "detector")}
    return session.connection().execute(update(AdapterRelation).where(*key).values(changed)).rowcount


#: relations whose child is a copy of its parent's update (the parent the first stored: the weights give no order)
COPIES = ("identical", "rescaled", "cast")


def copy_edges(session: Session, ids: Sequence[int]) -> list[tuple[int, int, str]]:
    """(child, parent, detector) of the stored copy edges whose child is one of `ids` (a copy names the first stored
    of its sources as its parent, the lowest id: the weights give no order)."""
    if not ids:
        return []
    rows = select(AdapterRelation.child_id, AdapterRelation.parent_id, AdapterRelation.detector).where(
        AdapterRelation.child_id.in_(list(ids)), AdapterRelation.relation.in_(COPIES)
    )
    return [(child, parent, detector) for child, parent, detector in session.execute(rows)]


def merges_naming(session: Session, parent_id: int) -> dict[int, list[int]]:
    """{merge: its stored parents} of the merges that name this adapter as a parent."""
    children = select(AdapterRelation.child_id).where(AdapterRelation.parent_id == parent_id, AdapterRelation.relation == "merge")
    rows = session.execute(
        select(AdapterRelation.child_id, AdapterRelation.parent_id)
        .where(AdapterRelation.child_id.in_(children), AdapterRelation.relation == "merge")
        .order_by(AdapterRelation.child_id, AdapterRelation.parent_id)
    )
    found: dict[int, list[int]] = {}
    for child, parent in rows:
        found.setdefault(child, []).append(parent)
    return found


def pending_scans(session: Session, embedder_id: int, detector: str, read_budget: int, ids: Iterable[int] | None = None) -> list[int]:
    """The adapters with a vector under this (module sketch) embedder and no scan by `detector` that succeeded under
    this `read_budget` or a smaller one (only among `ids` when given), in id order: one anti-join on the scan table's
    primary key."""
    whole = or_(RelationScan.read_budget.is_(None), RelationScan.read_budget >= read_budget)
    done = exists().where(
        RelationScan.adapter_id == Embedding.adapter_id, RelationScan.detector == detector, RelationScan.error.is_(None), whole
    )
    stmt = select(Embedding.adapter_id).where(Embedding.embedder_id == embedder_id, ~done)
    if ids is not None:
        stmt = stmt.where(Embedding.adapter_id.in_(list(ids)))
    return list(session.scalars(stmt.order_by(Embedding.adapter_id)))


def scanned_before(session: Session, close: Mapping[int, Sequence[int]], embedder_id: int) -> dict[int, list[int]]:
    """For each adapter of `close` (an adapter: its close neighbours), those of its neighbours whose last scan searched
    a version of the space older than the adapter's vector under the embedder: the adapter was not among their
    neighbours then. Two queries for all of them (embeddings by unique key, scans by primary key)."""
    keys = list(close)
    others = sorted({i for ids in close.values() for i in ids})
    if not keys or not others:
        return {a: [] for a in keys}
    mine = select(Embedding.adapter_id, Embedding.version).where(Embedding.embedder_id == embedder_id, Embedding.adapter_id.in_(keys))
    embedded = {adapter: version for adapter, version in session.execute(mine)}
    scans = select(RelationScan.adapter_id, RelationScan.space_version).where(RelationScan.adapter_id.in_(others))
    scanned = {adapter: version for adapter, version in session.execute(scans)}
    return {a: [i for i in ids if a in embedded and i in scanned and scanned[i] < embedded[a]] for a, ids in close.items()}


# --- reading -----------------------------------------------------------------------------------------------------


class RelatedRef(TypedDict):
    id: int
    name: str


class Edge(TypedDict):
    """One stored edge as seen from one of its adapters: the other adapter, the relation and what it rests on."""

    relation: str
    adapter: RelatedRef
    parameters: dict[str, Any]
    evidence: dict[str, float | None]
    confidence: float
    detector: str
    found_at: str | None


class Scan(TypedDict):
    detector: str
    scanned_at: str | None
    error: str | None


class FromWeights(TypedDict):
    """The lineage's "from the weights" section: what the adapter derives from (`parents`: it is the child), what
    derives from it (`children`), whether it was scanned, and where its card's `base_model_relation` disagrees."""

    parents: list[Edge]
    children: list[Edge]
    scan: Scan | None
    card_relation: str | None
    disagreement: str | None


def _edges(session: Session, mine: ColumnElement[bool], other: Any, limit: int) -> list[Edge]:
    stmt: Select = (
        select(AdapterRelation, Adapter.id, Adapter.name)
        .join(Adapter, Adapter.id == other)
        .where(mine)
        .order_by(AdapterRelation.confidence.desc(), AdapterRelation.id)
        .limit(limit)
    )
    return [
        {
            "relation": r.relation,
            "adapter": {"id": other_id, "name": name},
            "parameters": dict(r.parameters or {}),
            "evidence": dict(r.evidence or {}),
            "confidence": r.confidence,
            "detector": r.detector,
            "found_at": iso_seconds(r.created_at),
        }
        for r, other_id, name in session.execute(stmt)
    ]


def from_weights(session: Session, adapter_id: int, card_relation: str | None, limit: int = LISTED) -> FromWeights:
    """The adapter's edges both ways (the most confident `limit` each way) and its scan; `disagreement` says where the
    card states a `base_model_relation` that a relation found from the weights contradicts (e.g. the card says
    "adapter", the weights a merge of stored adapters)."""
    parents = _edges(session, AdapterRelation.child_id == adapter_id, AdapterRelation.parent_id, limit)
    children = _edges(session, AdapterRelation.parent_id == adapter_id, AdapterRelation.child_id, limit)
    scan = session.get(RelationScan, adapter_id)
    return {
        "parents": parents,
        "children": children,
        "scan": {"detector": scan.detector, "scanned_at": iso_seconds(scan.scanned_at), "error": scan.error} if scan else None,
        "card_relation": card_relation,
        "disagreement": _disagreement(card_relation, parents),
    }


def _disagreement(card_relation: str | None, parents: list[Edge]) -> str | None:
    if card_relation is None:
        return None
    for e in parents:  # the most confident first
        word = CARD_WORDS.get(e["relation"])
        if word is not None and word != card_relation:
            return (
                f"the card says {card_relation!r}; the weights say {word!r} ({e['relation']} of #{e['adapter']['id']} "
                f"{e['adapter']['name']}, confidence {e['confidence']:.2f})"
            )
    return None


# --- catalog filters ---------------------------------------------------------------------------------------------

#: catalog filter keys answered from the edges: `relation=<type>` keeps the adapters found to be that relation of a
#: stored adapter (`relation=merge`: the merges), `derived_from=<id>` those found to derive from that adapter
RELATION_FILTERS = ("relation", "derived_from")


def relation_filter(key: str, value: str) -> ColumnElement[bool]:
    """The condition on Adapter of a relation filter, read through the edges' indexes."""
    if key == "relation":
        if value not in RELATIONS:
            raise UsageError(f"filter relation={value!r}: one of {', '.join(RELATIONS)}")
        return Adapter.id.in_(select(AdapterRelation.child_id).where(AdapterRelation.relation == value))
    if not (value.isascii() and value.isdigit() and len(value) <= 9):
        raise UsageError(f"filter derived_from={value!r}: an adapter id")
    return Adapter.id.in_(select(AdapterRelation.child_id).where(AdapterRelation.parent_id == int(value)))
