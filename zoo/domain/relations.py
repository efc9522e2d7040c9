"""Relations found from the weights: how a query adapter relates to k stored candidates of its structure.

`find_relations` runs the three detectors on one query and its candidates (the engine's nearest neighbours
at ingest, k ≤ 32), costing O(k) inner products of low-rank updates plus a few r×r fits per module:

- a transform of one update (zoo/domain/transforms.py): identical, rescaled, cast to bf16/fp16 and back,
  truncated to the top-k of its SVD, magnitude-pruned, or a chain of these; tried both ways (the query from a
  candidate, then a candidate from the query);
- a merge of 2-3 candidates (zoo/domain/merges.py): parents, weights and PEFT's combination (cat, svd,
  linear) where the weights and residual say it, else `approximate`;
- a continuation (zoo/domain/continuation.py): one training run at two points, and which came first; a query
  later than several candidates keeps the one it shares most with as its parent (an adapter has one origin).

Inputs are `Update`s: canonical factors per module (what the blob store keeps) and the summary of the factors as
read from the file (`FactorSummary`, kept at ingest: precisions, exact zeros). Every edge carries its evidence
(named numbers) and a confidence in [0, 1], an ordering score until a lineage recipe calibrates it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zoo.domain.continuation import ContinuationEdge, detect_continuation, origin_score
from zoo.domain.lowrank import fill_blocks
from zoo.domain.merges import MergeEdge, detect_merge
from zoo.domain.transforms import FactorSummary, TransformEdge, Update, detect_transform, same_structure

__all__ = ["DETECTOR", "ContinuationEdge", "FactorSummary", "MergeEdge", "Relations", "TransformEdge", "Update", "find_relations"]

#: the detectors' version, stored with every edge they find: a new one makes the relation step scan every adapter again
DETECTOR = "provenance-7"


@dataclass(frozen=True)
class Relations:
    """What the weights say of a query against its candidates."""

    transforms: tuple[TransformEdge, ...] = ()
    merge: MergeEdge | None = None
    continuations: tuple[ContinuationEdge, ...] = ()


def find_relations(query: Update, candidates: Sequence[Update]) -> Relations:
    """Transforms first (either way); a merge and continuations only where no transform explains the query, and no
    continuation with a parent of the merge found: the merge explains why the query is like each of its parents (a
    merge mostly of one parent passes the continuation test with it). Every detector compares updates of one structure
    only: without such a candidate nothing is read of the query (its float64 modules cost as much as its sketches)."""
    candidates = _comparable(query, candidates)
    if not candidates:
        return Relations()
    transforms = [edge for c in candidates if (edge := _transform_either_way(query, c)) is not None]
    if transforms:
        return Relations(transforms=tuple(transforms))
    merge = detect_merge(query, candidates)
    parents = {i for i in merge.parents if i is not None} if merge is not None else set()
    others = [c for c in candidates if c.id is None or c.id not in parents]
    found = [e for c in others if (e := detect_continuation(query, c)) is not None]
    later = [e for e in found if e.query_is_later]
    parent = _origin(later, {c.id: c for c in others})
    return Relations(merge=merge, continuations=tuple(e for e in found if not e.query_is_later or e is parent))


def find_merge(query: Update, candidates: Sequence[Update]) -> MergeEdge | None:
    """The merge `find_relations` finds (None where a transform explains the query), without its continuations."""
    candidates = _comparable(query, candidates)
    if not candidates:
        return None
    if any(_transform_either_way(query, c) is not None for c in candidates):
        return None
    return detect_merge(query, candidates)


def _comparable(query: Update, candidates: Sequence[Update]) -> list[Update]:
    """The candidates of the query's structure, the only ones a detector compares, with the query's pair blocks with
    them made at once (every test reads its pairs' off them); where there is none, nothing of the query is read."""
    same = [c for c in candidates if same_structure(query, c)]
    if same:
        fill_blocks(query.modules(), [c.modules() for c in same])
    return same


def _origin(later: Sequence[ContinuationEdge], by_id: Mapping[int | None, Update]) -> ContinuationEdge | None:
    """Of the candidates the query continues, its one parent: the highest origin score; but where that candidate is a
    transform of an earlier stored one that the query continues too (its pruned copy, say, which shares the rows it
    kept: 0.676 against the root's 0.675 on the lineage recipe), the first stored of them, as a merge names it."""
    best = max(later, key=lambda e: origin_score(e.evidence), default=None)
    if best is None or best.other is None:
        return best
    earlier = sorted((e for e in later if e.other is not None and e.other < best.other), key=lambda e: e.other or 0)
    return next((e for e in earlier if _transform_either_way(by_id[best.other], by_id[e.other]) is not None), best)


def _transform_either_way(a: Update, b: Update) -> TransformEdge | None:
    """The transform that makes a from b, else b from a, if any."""
    return detect_transform(a, b) or detect_transform(b, a)
