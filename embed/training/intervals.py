"""Percentile intervals of a mean whose values come in clusters: a bootstrap that resamples clusters, one factor of
them or two crossed ones, never single values.

Why a function here and not a library: scipy.stats.bootstrap resamples single observations (`paired` only keeps the
pairs of one observation together) and arch's bootstraps resample observations or blocks of a time series; neither
resamples clusters, let alone two crossed factors of them (a query's split and its task), which `zoo eval` needs:
queries of one split share its W2T and its choice, and queries of one task share its adapters across splits.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

#: resamples per interval
RESAMPLES = 2000
#: the intervals' coverage
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A mean with its percentile interval; `clusters`: how many distinct clusters each factor had."""

    mean: float
    low: float
    high: float
    clusters: tuple[int, ...]

    @property
    def clear(self) -> bool:
        """Whether the interval leaves out 0."""
        return self.low > 0 or self.high < 0


def clustered_bootstrap(
    values: Sequence[float] | np.ndarray,
    factors: Sequence[Sequence[Hashable]],
    resamples: int = RESAMPLES,
    level: float = LEVEL,
    seed: int = 0,
) -> Interval:
    """The mean of `values` and its percentile interval at `level`, resampling the clusters of each factor in
    `factors` (a label per value each, e.g. the split and the query's task).

    Each resample draws every factor's clusters with replacement, independently, and weighs a value by the product
    of how many times its clusters were drawn; its statistic is the weighted mean. With one factor that is the usual
    cluster bootstrap; with two crossed ones it is Owen's pigeonhole bootstrap (Owen 2007, Ann. Appl. Stat.), which
    counts both the variation between splits and between tasks and errs on the wide side. A resample whose drawn
    clusters hold no value (two factors whose drawn clusters never meet) is left out. The values of one cluster
    never count as independent, so the interval is as wide as the clusters disagree: equal values give a
    zero-width interval at their value, and more clusters of the same spread narrow it."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or not len(v):
        raise ValueError("the bootstrap needs a non-empty list of values")
    if not factors:
        raise ValueError("the bootstrap needs at least one factor of clusters")
    if not 0 < level < 1 or resamples < 1:
        raise ValueError(f"level must be between 0 and 1 and resamples at least 1, got {level} and {resamples}")
    rng = np.random.default_rng(seed)
    weights = np.ones((resamples, len(v)))
    sizes = []
    for labels in factors:
        if len(labels) != len(v):
            raise ValueError(f"a factor has {len(labels)} labels for {len(v)} values")
        index: dict[Hashable, int] = {}
        codes = np.array([index.setdefault(label, len(index)) for label in labels])
        drawn = rng.multinomial(len(index), np.full(len(index), 1 / len(index)), size=resamples)
        weights *= drawn[:, codes]
        sizes.append(len(index))
    total = weights.sum(axis=1)
    kept = total > 0
    centre = v[0]  # an offset from one value: equal values give that value exactly, not a rounded v·w/w
    stats = centre + (weights[kept] @ (v - centre)) / total[kept]
    low, high = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return Interval(centre + float((v - centre).mean()), float(low), float(high), tuple(sizes))
