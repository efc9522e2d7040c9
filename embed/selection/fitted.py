"""The few-label channel metrics (zoo/domain/channel_metric.py) as candidates of the out-of-fold choice (embed/selection/choice.py).

One metric per purpose, each named by `fitted_score(purpose)`: "search" (the listwise objective over the tasks), each
attribute (the task kNN's objective, NCA, over its labels) and each measured metric (the performance kNN's, over its
values). The choice scores a candidate on the labelled adapters each W2T member held out, against the others; so a
metric's out-of-fold similarity is fitted, per member, on the labelled adapters that member trained on only
(`out_of_fold`), and a held-out adapter's row is that metric's (the mean of the metrics of the members that held it
out, as its W2T cosine is theirs). What is served is fitted on every labelled adapter (`fit_all`).

The metric needs every labelled pair's atoms: it is a candidate where the exact scores come from factors (a module
store fits ZOO_MODULE_STORE_BYTES) and at most MAX_LABELLED adapters are labelled (`unavailable` says why not).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from embed.selection.choice import Fold
from zoo.domain.channel_metric import FOLDS, Bank, ChannelMetric, fit_metric
from zoo.domain.fusion import fused_among
from zoo.domain.methods import fitted_score, fused_score

#: the most labelled adapters the metrics are fitted on: the bank holds 7 channels × module groups × n² float64 (400:
#: 108 MB with 12 groups), and a fit's cost grows with n²
MAX_LABELLED = 400
#: a purpose with fewer known targets than this among the rows a metric is fitted on gets no metric there (its inner
#: cross-validation needs some in each of its FOLDS folds)
MIN_TARGETS = 2 * FOLDS


@dataclass(frozen=True)
class Purpose:
    """What one metric is fitted for: its objective (channel_metric.OBJECTIVES) and per labelled adapter its target
    (a task or label, "" unknown; or a value, NaN unknown)."""

    objective: str
    targets: Sequence[str] | np.ndarray

    def known(self, rows: Sequence[int]) -> list[int]:
        """The rows whose target is known."""
        if self.objective == "performance":
            values = np.asarray(self.targets, dtype=np.float64)
            return [r for r in rows if np.isfinite(values[r])]
        return [r for r in rows if self.targets[r]]

    def fit(self, bank: Bank, rows: Sequence[int]) -> ChannelMetric | None:
        """The metric fitted on those of `rows` with a known target (None where they are too few)."""
        known = np.asarray(self.known(rows), dtype=np.int64)
        if len(known) < MIN_TARGETS or (self.objective != "performance" and len({self.targets[r] for r in known}) < 2):
            return None
        targets = np.asarray(self.targets, dtype=np.float64)[known] if self.objective == "performance" else [self.targets[r] for r in known]
        try:
            return fit_metric(bank.take(known, known), targets, self.objective)
        except ValueError:  # no atom varies over these adapters: nothing to weigh
            return None


def unavailable(bank: Bank | None, source: str, labelled: int) -> str | None:
    """Why the metrics are not candidates (None: they are); `source`: what the exact scores came from ("factors",
    "module sketches")."""
    if bank is None and source != "factors":
        return f"no channel metric: the exact scores come from {source} (the space's module store would pass ZOO_MODULE_STORE_BYTES)"
    if labelled > MAX_LABELLED:
        return f"no channel metric: {labelled} labelled adapters, more than the {MAX_LABELLED} it is fitted on"
    if bank is None:
        return "no channel metric: no atoms among the labelled adapters"
    return None


def out_of_fold(bank: Bank, purposes: dict[str, Purpose], folds: list[Fold]) -> dict[str, np.ndarray]:
    """Per purpose with a metric in every fold that holds an adapter out, by `fitted_score` name: the labelled × labelled
    similarity whose row of a held-out adapter is the mean of the metrics fitted on the labelled adapters of the folds
    that held it out (NaN for a row no fold held out: no honest value)."""
    n = bank.values.shape[1]
    out: dict[str, np.ndarray] = {}
    for purpose, p in purposes.items():
        total, count = np.zeros((n, n)), np.zeros(n)
        for f in folds:
            if not f.val:
                continue
            metric = p.fit(bank, f.train)
            if metric is None:
                break
            total[f.val] += metric.similarity(bank.take(f.val, np.arange(n)))
            count[f.val] += 1
        else:
            if count.any():
                out[fitted_score(purpose)] = np.where(count[:, None] > 0, total / np.maximum(count, 1)[:, None], np.nan)
    return out


def fit_all(bank: Bank, purposes: dict[str, Purpose]) -> dict[str, ChannelMetric]:
    """Per purpose, by `fitted_score` name, the metric fitted on every labelled adapter with a known target: what is
    served."""
    rows = list(range(bank.values.shape[1]))
    fitted = {fitted_score(purpose): p.fit(bank, rows) for purpose, p in purposes.items()}
    return {name: m for name, m in fitted.items() if m is not None}


#: the purposes whose channel metric is also a candidate fused with dW (zoo/domain/fusion.py): search's
FUSED_PURPOSES = ("search",)


def with_fused(exact: dict[str, np.ndarray], reference: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
    """`exact` (square: rows and columns the same adapters) with, for each of FUSED_PURPOSES whose channel metric it
    holds, that metric fused with dW, each row on the scale of its scores against the `reference` adapters (positions:
    the labelled ones, as served), itself left out."""
    fused = {
        fused_score(p): fused_among(exact["dw"], exact[m], np.asarray(reference)) for p in FUSED_PURPOSES if (m := fitted_score(p)) in exact
    }
    return {**exact, **fused}
