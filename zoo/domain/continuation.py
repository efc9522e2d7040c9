"""Continuations: whether a query adapter and a candidate are one training run at two points, and which came first.

A continuation shares the module structure and per-module ranks, is similar (module cosine at least
CONTINUATION_MIN_COSINE) but is no transform of the other (zoo/domain/transforms.py finds those). Its
direction comes from statistics that move monotonically with training (MoTHer: Horwitz et al.), listed in
`STATISTICS` with the way each is expected to move. Only the update's norm decides by default (LoRA's B
starts at zero, so ‖dW‖ grows with steps); the others are computed and reported beside it, with what each
says, until a lineage recipe measures which of them work for LoRA updates.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from zoo.domain.lowrank import LowRank, inner, sample_entries, sq_norm
from zoo.domain.transforms import Update, fit_scale, residual_class, same_structure

#: least module cosine of a continuation; a default to be measured on a lineage recipe
CONTINUATION_MIN_COSINE = 0.5
#: the relative change of a statistic that gives its vote full strength in a direction's confidence
FULL_MARGIN = 0.1


@dataclass(frozen=True)
class StatisticVote:
    """One statistic of both adapters and what it says of the direction."""

    name: str
    query: float
    candidate: float
    query_is_later: bool | None  # None when the statistic does not vote (no known direction, or a tie)
    margin: float  # |Δ| / mean of both


@dataclass(frozen=True)
class ContinuationEdge:
    """The query and candidate `other` are one training run at two points; `query_is_later` says which is the child."""

    other: int | None
    query_is_later: bool
    confidence: float  # that the two are a continuation
    direction_confidence: float  # that the direction is right
    votes: tuple[StatisticVote, ...]
    evidence: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Statistic:
    """A statistic of an adapter's update and how it is expected to move with training (+1 grows, -1 falls, 0 unknown)."""

    name: str
    compute: Callable[[Mapping[str, LowRank]], float]
    with_training: int


def _norm(mods: Mapping[str, LowRank]) -> float:
    return math.sqrt(sum(sq_norm(x) for x in mods.values()))


def _mean_stable_rank(mods: Mapping[str, LowRank]) -> float:
    return float(np.mean([(x.S**2).sum() / x.S[0] ** 2 for x in mods.values()]))


def _mean_spectral_norm(mods: Mapping[str, LowRank]) -> float:
    return float(np.mean([x.S[0] for x in mods.values()]))


#: rows and columns of dW sampled per module for the kurtosis (seeded: both adapters see the same entries)
KURTOSIS_SAMPLE = 64


def _mean_kurtosis(mods: Mapping[str, LowRank]) -> float:
    """Mean over modules of the excess kurtosis of dW's entries, from a seeded block of rows and columns."""
    values = []
    for x in mods.values():
        rng = np.random.default_rng(0)
        out, inp = x.shape
        rows = np.sort(rng.choice(out, size=min(out, KURTOSIS_SAMPLE), replace=False))
        cols = np.sort(rng.choice(inp, size=min(inp, KURTOSIS_SAMPLE), replace=False))
        e = sample_entries(x, rows, cols).ravel()
        e = e - e.mean()
        var = float((e**2).mean())
        values.append(float((e**4).mean()) / var**2 - 3.0 if var > 0 else 0.0)
    return float(np.mean(values))


#: the statistics computed for a direction, each with its expected move (to be measured on a lineage recipe:
#: norm from LoRA's B = 0 start; kurtosis rises in fine-tuning per MoTHer; stable rank a guess, not voting)
STATISTICS: tuple[Statistic, ...] = (
    Statistic("norm", _norm, +1),
    Statistic("spectral_norm", _mean_spectral_norm, +1),
    Statistic("kurtosis", _mean_kurtosis, +1),
    Statistic("stable_rank", _mean_stable_rank, 0),
)
#: the statistics whose votes decide the direction by default
DEFAULT_DIRECTION_STATISTICS = ("norm",)


def module_cosine(q: Mapping[str, LowRank], p: Mapping[str, LowRank]) -> float:
    """Mean over modules of the per-module cosine of dW."""
    return float(np.mean([inner(q[n], p[n]) / math.sqrt(sq_norm(q[n]) * sq_norm(p[n])) for n in q]))


def detect_continuation(
    query: Update,
    candidate: Update,
    min_cosine: float = CONTINUATION_MIN_COSINE,
    statistics: Sequence[Statistic] = STATISTICS,
    deciding: Sequence[str] = DEFAULT_DIRECTION_STATISTICS,
) -> ContinuationEdge | None:
    """Whether query and candidate are one run at two points (and which is later), or None. Call it for pairs
    that are no transform (`detect_transform` finds those)."""
    if not same_structure(query, candidate):
        return None
    q, p = query.modules(), candidate.modules()
    if not q or q.keys() != p.keys() or any(q[n].rank != p[n].rank for n in q):
        return None
    fit = fit_scale(q, p)
    if residual_class(fit.rho) is not None:  # a copy, not further training
        return None
    cosine = module_cosine(q, p)
    if cosine < min_cosine:
        return None
    votes = tuple(_vote(s, _statistic(query, s), _statistic(candidate, s)) for s in statistics)
    decisive = [v for v in votes if v.name in deciding and v.query_is_later is not None]
    score = sum((1.0 if v.query_is_later else -1.0) * min(1.0, v.margin / FULL_MARGIN) for v in decisive)
    overlap = float(np.mean([np.linalg.norm(q[n].V.T @ p[n].V) ** 2 / q[n].rank for n in q]))
    return ContinuationEdge(
        other=candidate.id,
        query_is_later=score >= 0,
        confidence=(cosine - min_cosine) / (1.0 - min_cosine),
        direction_confidence=0.5 + 0.5 * abs(score) / max(len(decisive), 1),
        votes=votes,
        evidence={"module_cosine": cosine, "relative_residual": fit.rho, "scale": fit.scale, "row_space_overlap": overlap},
    )


def _statistic(u: Update, stat: Statistic) -> float:
    """The statistic of an update, computed once whatever the pairs it is in."""
    return u.computed(f"statistic:{stat.name}", lambda: stat.compute(u.modules()))


def _vote(stat: Statistic, query: float, candidate: float) -> StatisticVote:
    mean = (abs(query) + abs(candidate)) / 2
    margin = abs(query - candidate) / mean if mean > 0 else 0.0
    later = None if stat.with_training == 0 or query == candidate else (query - candidate) * stat.with_training > 0
    return StatisticVote(stat.name, query, candidate, later, margin)
