"""Continuations: whether a query adapter and a candidate are one training run at two points, and which came first.

A continuation shares the module structure and per-module ranks, is no transform of the other
(zoo/domain/transforms.py finds those) and shares its row spaces: LoRA's A starts at a random init and moves little
in training while B, from zero, learns the update, so dW = B·A of one run keeps A's rows at every point, even trained
further on another task (dW's cosine then falls to 0), where two runs from other inits share no more of them than
random subspaces do (`shared_rows`, at least MIN_SHARED_ROWS). Two runs started from one init (the same seed, or an
init read off the base model such as PiSSA's) share them too, and read as related. Where no module can tell (a rank
above half the module's inputs) the module cosine decides, at least CONTINUATION_MIN_COSINE. Its direction comes from
statistics that move monotonically with training (MoTHer: Horwitz et al.), listed in `STATISTICS` with the way each is
expected to move. Only the update's norm decides by default (LoRA's B starts at zero, so ‖dW‖ grows with steps); the
others are computed and reported beside it, with what each says.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from zoo.domain.lowrank import LowRank, blocks, inner, sample_entries, sq_norm
from zoo.domain.transforms import Update, fit_scale, residual_class, same_structure

#: least module cosine of a continuation where no module's row space can tell
CONTINUATION_MIN_COSINE = 0.5
#: least `shared_rows` of a continuation: on two shapes-lineage zoos a continuation shares 0.30-1.00 of its rows with
#: its parent (median 0.81), unrelated adapters at most 0.60 (median 0.02-0.05); the bar sits above every unrelated pair
MIN_SHARED_ROWS = 0.65
#: a module tells whether rows are shared where random subspaces of its ranks would share at most this of them
MAX_CHANCE = 0.5
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


def shared_rows(q: Mapping[str, LowRank], p: Mapping[str, LowRank]) -> float | None:
    """How much of dW's row space two updates share beyond chance, the mean over modules that can tell (None if
    none can): per module ‖V_q'·V_p‖²_F / min rank, 1 when one's rows lie in the other's, rescaled so that
    independent random subspaces (expected max rank / inputs) give 0."""
    values = []
    for n in q:
        inputs, low, high = q[n].shape[1], min(q[n].rank, p[n].rank), max(q[n].rank, p[n].rank)
        chance = high / inputs
        if chance <= MAX_CHANCE and low > 0:
            overlap = float(np.linalg.norm(blocks(q[n], p[n])[1]) ** 2) / low  # V_qᵀV_p, kept for the pair
            values.append((overlap - chance) / (1.0 - chance))
    return float(np.mean(values)) if values else None


def detect_continuation(
    query: Update,
    candidate: Update,
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
    cosine, shared = module_cosine(q, p), shared_rows(q, p)
    if shared is None:
        if cosine < CONTINUATION_MIN_COSINE:
            return None
        confidence = (cosine - CONTINUATION_MIN_COSINE) / (1.0 - CONTINUATION_MIN_COSINE)
    elif shared < MIN_SHARED_ROWS:
        return None
    else:
        confidence = min(1.0, (shared - MIN_SHARED_ROWS) / (1.0 - MIN_SHARED_ROWS))
    votes = tuple(_vote(s, _statistic(query, s), _statistic(candidate, s)) for s in statistics)
    decisive = [v for v in votes if v.name in deciding and v.query_is_later is not None]
    score = sum((1.0 if v.query_is_later else -1.0) * min(1.0, v.margin / FULL_MARGIN) for v in decisive)
    evidence = {"module_cosine": cosine, "relative_residual": fit.rho, "scale": fit.scale}
    return ContinuationEdge(
        other=candidate.id,
        query_is_later=score >= 0,
        confidence=confidence,
        direction_confidence=0.5 + 0.5 * abs(score) / max(len(decisive), 1),
        votes=votes,
        evidence=evidence if shared is None else {**evidence, "shared_rows": shared},
    )


def origin_score(evidence: Mapping[str, float | None]) -> float:
    """How strongly a continuation ties its child to that parent: the rows they share, else their module cosine. A
    child later than several candidates is the continuation of the highest: a run's root is the centre of its
    continuations (each drifted from it on its own), and a pruned or merged copy of it shares fewer of its rows."""
    value = evidence.get("shared_rows", evidence.get("module_cosine"))
    return float("-inf") if value is None else float(value)


def _statistic(u: Update, stat: Statistic) -> float:
    """The statistic of an update, computed once whatever the pairs it is in."""
    return u.computed(f"statistic:{stat.name}", lambda: stat.compute(u.modules()))


def _vote(stat: Statistic, query: float, candidate: float) -> StatisticVote:
    mean = (abs(query) + abs(candidate)) / 2
    margin = abs(query - candidate) / mean if mean > 0 else 0.0
    later = None if stat.with_training == 0 or query == candidate else (query - candidate) * stat.with_training > 0
    return StatisticVote(stat.name, query, candidate, later, margin)
