"""Labels an adapter inherits along its stored edges (graph imputation): its confident edges both ways, the
given labels at their other ends, and zoo.domain.imputation's rules. Three indexed look-ups (edges by child, by
parent, labels by adapter), so it costs the adapter's edges, never the zoo's size."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple, TypedDict

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from zoo.domain.imputation import DEFAULT_KINDS, MIN_CONFIDENCE, Imputation, Kind, Link, carrying, impute
from zoo.store.models import Adapter, AdapterRelation, Label
from zoo.store.relations import LISTED, RelatedRef
from zoo.store.repository import COLUMN_FILTERS

#: keys the adapter's own row answers, never inherited: the catalog's column and relation filters (rank, format, its
#: source's fields, relation, derived_from), and the alpha and target modules read from its file. On the lineage recipe
#: the copy a held-out adapter's task came from had another alpha for 42-58 % of them, another rank for 16-23 % and
#: another `relation` label for 77-100 % (docs/history/results-2026.md, "Graph imputation")
OWN_FACTS = frozenset({*COLUMN_FILTERS, "alpha", "target_modules"})


class Source(TypedDict):
    """An adapter a value came from: what it is of this one (`direction`: its parent or its child in `relation`), how
    sure the edge is, and a merge parent's weight."""

    adapter: RelatedRef
    relation: str
    direction: str  # parent | child
    confidence: float
    weight: float | None


class InheritedValue(TypedDict):
    value: str
    score: float
    sources: list[Source]


class InheritedLabel(TypedDict):
    """A key's inherited values, best first: `kind` merge means all of them (a merge does its parents' tasks;
    `complete` when every parent found has the label), else the first is the prediction."""

    kind: str
    values: list[InheritedValue]
    complete: bool


class FromLineage(TypedDict):
    """What the adapter inherits from the given labels of the adapters its confident edges join it to (not the keys it
    has a given label for, nor OWN_FACTS), the edges read, and the rules' settings."""

    attributes: dict[str, InheritedLabel]
    edges: int
    min_confidence: float
    kinds: list[str]


def from_lineage(
    session: Session, adapter_id: int, min_confidence: float = MIN_CONFIDENCE, kinds: Sequence[Kind] = DEFAULT_KINDS, limit: int = LISTED
) -> FromLineage:
    """The labels the adapter inherits along its edges at confidence at least `min_confidence` (the most confident
    `limit` each way), through the kinds of edges named (zoo.domain.imputation.KINDS)."""
    relations = carrying(kinds)
    ends = [
        *_ends(session, AdapterRelation.child_id == adapter_id, AdapterRelation.parent_id, "parent", relations, min_confidence, limit),
        *_ends(session, AdapterRelation.parent_id == adapter_id, AdapterRelation.child_id, "child", relations, min_confidence, limit),
    ]
    labels: dict[int, dict[str, str]] = {i: {} for i in (adapter_id, *(e.other for e in ends))}
    stmt = select(Label.adapter_id, Label.key, Label.value).where(Label.adapter_id.in_(list(labels)), Label.source == "given")
    for owner, key, value in session.execute(stmt):
        labels[owner][key] = value
    links = [Link(e.other, e.relation, e.direction, e.confidence, labels[e.other], e.weight) for e in ends]
    names = {e.other: e.name for e in ends}
    imputed = impute(links, known={*labels[adapter_id], *OWN_FACTS}, min_confidence=min_confidence, kinds=kinds)
    return {
        "attributes": {key: _inherited(i, names) for key, i in imputed.items()},
        "edges": len(links),
        "min_confidence": min_confidence,
        "kinds": list(kinds),
    }


class _End(NamedTuple):
    """An edge's other end as read."""

    other: int
    name: str
    direction: Literal["parent", "child"]
    relation: str
    confidence: float
    weight: float | None


def _ends(
    session: Session,
    mine: ColumnElement[bool],
    other: InstrumentedAttribute[int],
    direction: Literal["parent", "child"],
    relations: frozenset[str],
    min_confidence: float,
    limit: int,
) -> list[_End]:
    stmt = (
        select(other, Adapter.name, AdapterRelation.relation, AdapterRelation.confidence, AdapterRelation.parameters)
        .join(Adapter, Adapter.id == other)
        .where(mine, AdapterRelation.relation.in_(sorted(relations)), AdapterRelation.confidence >= min_confidence)
        .order_by(AdapterRelation.confidence.desc(), AdapterRelation.id)
        .limit(limit)
    )
    return [
        _End(int(i), name, direction, relation, float(confidence), _weight(parameters))
        for i, name, relation, confidence, parameters in session.execute(stmt)
    ]


def _weight(parameters: Mapping[str, Any] | None) -> float | None:
    weight = (parameters or {}).get("weight")
    return float(weight) if weight is not None else None


def _inherited(imputation: Imputation, names: Mapping[int, str]) -> InheritedLabel:
    return {
        "kind": imputation.kind,
        "values": [
            {
                "value": v.value,
                "score": v.score,
                "sources": [
                    {
                        "adapter": {"id": s.other, "name": names[s.other]},
                        "relation": s.relation,
                        "direction": s.other_is,
                        "confidence": s.confidence,
                        "weight": s.weight,
                    }
                    for s in v.sources
                ],
            }
            for v in imputation.values
        ],
        "complete": imputation.complete,
    }
