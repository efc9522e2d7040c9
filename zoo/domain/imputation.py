"""Graph imputation: labels an adapter inherits along the relations found from its weights.

An adapter without a label inherits the given labels of the adapters at the other end of its confident edges, one hop:

- a **copy** (identical, rescaled, cast, truncated, pruned: one update, so one task) carries every label both ways;
  a value's score is the confidence of the copies that carry it over all copies that know the key (copies that
  disagree split it);
- a **merge** inherits the union of its parents' values, each scored by its parents' share of the merge weights
  (times the edge's confidence): the merge does all of them, so the values together are the prediction, complete
  only where every parent has the label;
- a **continuation** (one training run at two points) carries labels both ways like a copy, only when asked: a run
  trained further may have been trained on another task, and the edge mostly joins adapters that share a root.

Per key the most direct kind that knows it answers: a copy's value, else a merge's union, else a continuation's.
Only the labels given at the other end are inherited, never a prediction of theirs. Pure: plain values in and out.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

#: relations of one update to another: the same task, whichever way the edge points
COPIES = frozenset({"identical", "rescaled", "cast", "truncated", "pruned"})
#: the least confidence of an edge that carries labels
MIN_CONFIDENCE = 0.5
Kind = Literal["copy", "merge", "continuation"]
#: the kinds of inheritance, the most direct first
KINDS: tuple[Kind, ...] = ("copy", "merge", "continuation")
#: the kinds that carry labels unless asked otherwise
DEFAULT_KINDS: tuple[Kind, ...] = ("copy", "merge")


@dataclass(frozen=True)
class Link:
    """An edge seen from the adapter: the adapter at its other end (`other`), which is the adapter's `parent` or its
    `child` in `relation`, the edge's confidence, a merge parent's weight, and the other end's given labels."""

    other: int
    relation: str
    other_is: Literal["parent", "child"]
    confidence: float
    labels: Mapping[str, str]
    weight: float | None = None


@dataclass(frozen=True)
class Inherited:
    """One inherited value, its score in [0, 1] and the links it came through."""

    value: str
    score: float
    sources: tuple[Link, ...]


@dataclass(frozen=True)
class Imputation:
    """A key's inherited values, best first. `kind` "merge": the adapter is predicted to have all of them (the union of
    its parents'), `complete` when every parent has the key (else the union may lack an unlabelled parent's value);
    otherwise the first is the prediction and the others are what disagreeing edges say."""

    key: str
    kind: Kind
    values: tuple[Inherited, ...]
    complete: bool = True


def carrying(kinds: Sequence[Kind]) -> frozenset[str]:
    """The relations whose edges carry labels for these kinds."""
    return frozenset((COPIES if "copy" in kinds else set()) | {k for k in ("merge", "continuation") if k in kinds})


def kind_of(link: Link) -> Kind | None:
    """How labels travel along a link: a copy (either way), a merge (from a parent to the merge only), a continuation."""
    if link.relation in COPIES:
        return "copy"
    if link.relation == "merge":
        return "merge" if link.other_is == "parent" else None
    return "continuation" if link.relation == "continuation" else None


def impute(
    links: Iterable[Link],
    known: Iterable[str] = (),
    min_confidence: float = MIN_CONFIDENCE,
    kinds: Sequence[Kind] = DEFAULT_KINDS,
) -> dict[str, Imputation]:
    """Per label key the adapter lacks (not in `known`), what it inherits through the links of `kinds` at confidence
    at least `min_confidence`: the most direct kind that knows the key answers (KINDS' order)."""
    skip = set(known)
    by_kind: dict[Kind, list[Link]] = defaultdict(list)
    for link in links:
        through = kind_of(link)
        if through is not None and through in kinds and link.confidence >= min_confidence:
            by_kind[through].append(link)
    out: dict[str, Imputation] = {}
    for kind in KINDS:
        mine = by_kind.get(kind, [])
        for key in sorted({k for link in mine for k in link.labels} - skip - set(out)):
            if kind == "merge":
                out[key] = Imputation(key, kind, _merged(mine, key), complete=all(key in link.labels for link in mine))
            else:
                out[key] = Imputation(key, kind, _shared(mine, key))
    return out


def _shared(links: Sequence[Link], key: str) -> tuple[Inherited, ...]:
    """Copies or continuations: a value's score is the confidence of the links that carry it over the links that know
    the key (one value carried by every link: their mean confidence)."""
    knowing = [link for link in links if key in link.labels]
    return _ranked(knowing, key, lambda link: link.confidence / len(knowing))


def _merged(links: Sequence[Link], key: str) -> tuple[Inherited, ...]:
    """A merge's parents: a value's score is the weight share of the parents that have it (of all the merge's parents,
    so that a parent without the label leaves its share unknown), times their edges' confidence."""
    total = sum(_weight(link) for link in links) or 1.0
    return _ranked([link for link in links if key in link.labels], key, lambda link: _weight(link) / total * link.confidence)


def _weight(link: Link) -> float:
    return max(link.weight, 0.0) if link.weight is not None else 1.0


def _ranked(links: Sequence[Link], key: str, share: Callable[[Link], float]) -> tuple[Inherited, ...]:
    scores: dict[str, float] = defaultdict(float)
    sources: dict[str, list[Link]] = defaultdict(list)
    for link in links:
        value = link.labels[key]
        scores[value] += share(link)
        sources[value].append(link)
    order = sorted(scores, key=lambda v: (-scores[v], v))
    return tuple(Inherited(v, min(scores[v], 1.0), tuple(sources[v])) for v in order)
