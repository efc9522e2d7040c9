"""The database rows of the relations the detectors found (zoo/domain/relations.py): one `EdgeRow` per edge, its
child and parent the stored adapters' ids (an edge naming None means the query), a copy's older adapter its parent,
numbers JSON cannot hold (inf, nan) stored as null."""

from __future__ import annotations

import math
from collections.abc import Mapping

from zoo.domain.relations import ContinuationEdge, MergeEdge, Relations, TransformEdge
from zoo.store.models import RelationParameters
from zoo.store.relations import COPIES, EdgeRow


def edge_rows(found: Relations, query_id: int) -> list[EdgeRow]:
    """The rows of what `find_relations` found for the adapter `query_id` (edges naming None mean it)."""
    rows = [_transform_row(e, query_id) for e in found.transforms]
    rows += merge_rows(found.merge, query_id) if found.merge is not None else []
    return rows + [_continuation_row(e, query_id) for e in found.continuations]


def _transform_row(e: TransformEdge, query_id: int) -> EdgeRow:
    child, parent, scale = _id(e.child, query_id), _id(e.parent, query_id), e.scale
    if e.relation in COPIES and parent > child:  # the weights do not say which came first: the older is the parent
        child, parent, scale = parent, child, 1.0 / scale if scale else scale
    params: RelationParameters = {"scale": float(scale), "steps": list(e.steps)}
    if e.precision is not None:
        params["precision"] = e.precision
    if e.kept_rank is not None:
        params["kept_rank"] = {n: int(k) for n, k in e.kept_rank.items()}
    if e.sparsity is not None:
        params["sparsity"] = float(e.sparsity)
    return _row(child, parent, e.relation, params, e.evidence, e.confidence)


def merge_rows(e: MergeEdge, child_id: int) -> list[EdgeRow]:
    rows = []
    for p, w in zip(e.parents, e.weights, strict=True):
        params: RelationParameters = {"weight": float(w), "combination": e.combination, "parents": len(e.parents)}
        rows.append(_row(child_id, _id(p, child_id), "merge", params, e.evidence, e.confidence))
    return rows


def _continuation_row(e: ContinuationEdge, query_id: int) -> EdgeRow:
    other = _id(e.other, query_id)
    child, parent = (query_id, other) if e.query_is_later else (other, query_id)
    votes = {f"{v.name}_{'child' if e.query_is_later else 'parent'}": v.query for v in e.votes}
    votes |= {f"{v.name}_{'parent' if e.query_is_later else 'child'}": v.candidate for v in e.votes}
    params: RelationParameters = {"direction_confidence": float(e.direction_confidence)}
    return _row(child, parent, "continuation", params, {**e.evidence, **votes}, e.confidence)


def _id(i: int | None, query_id: int) -> int:
    return query_id if i is None else i


def _row(child: int, parent: int, relation: str, params: RelationParameters, evidence: Mapping[str, float], confidence: float) -> EdgeRow:
    """An edge row; numbers that JSON cannot hold (inf, nan) are stored as null."""
    return {
        "child_id": child,
        "parent_id": parent,
        "relation": relation,
        "parameters": params,
        "evidence": {k: float(v) if math.isfinite(v) else None for k, v in evidence.items()},
        "confidence": float(confidence),
    }
