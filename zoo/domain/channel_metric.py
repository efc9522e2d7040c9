"""A few-label metric over the similarity channels × module groups (pure math, no I/O).

**The bank.** Per channel (zoo/domain/channels.py's, and the whole-update dW cosine) and per module group (a module's
type and depth bucket, read from its name), an atom: the group's part of the pair's channel value,
F_cg(x, y) = Σ_{m ∈ g, shared} c_m(x, y) / n(x, y) with n(x, y) the modules both adapters have, so that Σ_g F_cg is
channels.py's mean of channel c exactly; for dW cosine F_dw,g = Σ_{m ∈ g} ⟨dW_x,m, dW_y,m⟩ / (‖dW_x‖ ‖dW_y‖), which
sums over the groups to dW cosine. Everything comes from the canonical factors in r×r blocks (`channel_group_sums`,
`ModuleStack.module_cosines`).

**A metric** is s = Σ_a w_a F_a with weights w ≥ 0, normalised to sum to the number of module groups, so that weight
1 on every group of one channel is that channel exactly (the scale of s changes no ranking and no kNN vote).

**Fitting** uses the labelled adapters only, one objective at a time, on the softmax over the other labelled adapters
of each labelled anchor (p_ij ∝ exp s_ij):

- "search": listwise, the cross-entropy of p against the uniform distribution on the anchor's task: every relevant
  adapter is pulled up, as MRR and nDCG ask;
- "task": NCA, −log Σ_{j of the anchor's task} p_ij, the mass a similarity-weighted vote puts on the right task;
- "performance": the leave-one-out squared error of the kernel regression Σ_j p_ij y_j of the target's rank (of test
  accuracy, say: ranks are what a Spearman correlation scores, and no outlier dominates), over its variance.

Atoms are standardized (divided by their spread over the labelled pairs) and the fitted v ≥ 0 (any scale: the
temperature) is shrunk toward the prior v₀ by λ‖v − v₀‖² / ‖v₀‖². The prior is training-free in form: all weight on
one channel, the one whose loss on the labelled adapters is lowest at its best temperature (for performance: whose
leave-one-out 10-NN regression, as served, has the best Spearman correlation; the kernel regression's loss preferred
channels that a 10-NN serves worse). L-BFGS-B with bounds v ≥ 0, started from the prior, is deterministic. λ is chosen
from SHRINKS by inner K-fold cross-validation on the labelled adapters (held-out anchors against the fold's training
adapters, scored by the same loss, or for performance by the 10-NN's Spearman correlation; the prior is picked again
inside each fold); λ = ∞ is the prior itself, and a tie goes to the stronger shrink.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zoo.domain.channels import CHANNELS, channel_group_sums
from zoo.domain.naming import layer_index, module_type
from zoo.domain.similarity import ModuleStack

#: the bank's channels: the whole-update dW cosine and channels.py's
BANK = ("dw", *CHANNELS)
OBJECTIVES = ("search", "task", "performance")
#: the shrink strengths the inner cross-validation chooses from (∞: the prior)
SHRINKS = (0.01, 0.1, 1.0, 10.0, math.inf)
#: layer depth buckets of the module groups (a zoo with fewer layers has one per layer)
DEPTH_BUCKETS = 2
#: inner cross-validation folds
FOLDS = 4
#: neighbours of the kNN regression that the performance metric is chosen for (embed.selection.metrics.KNN_K)
KNN_K = 10
#: the prior's inverse temperature is searched in [e^-5, e^10]
_LOG_TEMPERATURE = (-5.0, 10.0)
#: an atom whose spread over the fit's pairs is below this is constant there
_CONSTANT = 1e-12


def module_groups(names: Sequence[str], buckets: int = DEPTH_BUCKETS) -> dict[str, str]:
    """Per module name its group, "type@depth": the module's type (`module_type`) and the bucket of its layer among
    the names' distinct layers (`layer_index`; "-" for a name without one), `buckets` equal shares from the first."""
    if buckets < 1:
        raise ValueError("depth buckets must be at least 1")
    layers = sorted({i for i in (layer_index(n) for n in names) if i is not None})
    at = {layer: p * min(buckets, len(layers)) // len(layers) for p, layer in enumerate(layers)}
    out: dict[str, str] = {}
    for name in names:
        layer = layer_index(name)
        out[name] = f"{module_type(name)}@{'-' if layer is None else at[layer]}"
    return out


@dataclass(frozen=True)
class Bank:
    """The atoms' values between queries and a gallery: `values[a]` (queries, gallery) float64 is atom
    `atoms[a]` = (channel, module group); `modules`: each module's group, as the bank was built."""

    atoms: tuple[tuple[str, str], ...]
    values: np.ndarray
    modules: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.values.ndim != 3 or self.values.shape[0] != len(self.atoms):
            raise ValueError(f"a bank of {len(self.atoms)} atoms needs values of shape (atoms, queries, gallery), not {self.values.shape}")

    @property
    def channels(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c for c, _ in self.atoms))

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(sorted({g for _, g in self.atoms}))

    def channel(self, channel: str) -> np.ndarray:
        """(queries, gallery) the channel's value: the sum of its atoms."""
        rows = [a for a, (c, _) in enumerate(self.atoms) if c == channel]
        if not rows:
            raise ValueError(f"channel {channel!r} is not in the bank; one of {self.channels}")
        return self.values[rows].sum(axis=0)

    def take(self, queries: Sequence[int] | np.ndarray, gallery: Sequence[int] | np.ndarray) -> Bank:
        """The bank between the given query rows and gallery columns."""
        return Bank(self.atoms, self.values[:, np.asarray(queries)[:, None], np.asarray(gallery)[None, :]], self.modules)


def bank_matrices(
    gallery: ModuleStack, queries: ModuleStack, buckets: int = DEPTH_BUCKETS, chunk: int = 2048, groups: Mapping[str, str] | None = None
) -> Bank:
    """Every channel of BANK per module group between the stacks; an atom's (queries, gallery) values are its group's
    part of the channel (0 where the pair shares no module). The groups: `module_groups` of the stacks' shared
    modules, or `groups` given (a fitted metric's: every group of it is an atom, and a module it does not name counts
    in none). On one BLAS thread, as the fit."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        return _bank_matrices(gallery, queries, buckets, chunk, groups)


def _bank_matrices(gallery: ModuleStack, queries: ModuleStack, buckets: int, chunk: int, groups: Mapping[str, str] | None) -> Bank:
    names = sorted(queries.norms.keys() & gallery.norms.keys())
    group_of = module_groups(names, buckets) if groups is None else {n: groups[n] for n in names if n in groups}
    total = np.maximum(np.outer(queries.total_norms(), gallery.total_norms()), 1e-30)  # every module's: dW cosine's norms
    gallery, queries = _only(gallery, group_of), _only(queries, group_of)
    kept = sorted(set(group_of.values()) if groups is None else set(groups.values()))
    sums, counts = channel_group_sums(gallery, queries, group_of.__getitem__, CHANNELS, chunk, inner_products=True)
    shared = np.maximum(sum((counts.get(g, 0) for g in kept), np.zeros((queries.size, gallery.size))), 1)
    atoms = tuple((c, g) for c in BANK for g in kept)
    empty = np.zeros((queries.size, gallery.size))
    values = [sums[c].get(g, empty) / (total if c == "dw" else shared) for c, g in atoms]
    return Bank(atoms, np.stack(values) if values else np.zeros((0, queries.size, gallery.size)), group_of)


def _only(stack: ModuleStack, keep: Mapping[str, str]) -> ModuleStack:
    """A view of the stack holding only the modules `keep` names."""
    return ModuleStack(
        stack.size,
        {n: v for n, v in stack.norms.items() if n in keep},
        {n: v for n, v in stack.dense.items() if n in keep},
        {n: v for n, v in stack.factors.items() if n in keep},
        {n: v for n, v in stack.svd.items() if n in keep},
    )


@dataclass(frozen=True)
class ChannelMetric:
    """Non-negative weights over a bank's atoms, fitted for one objective (see the module's docstring)."""

    objective: str
    atoms: tuple[tuple[str, str], ...]
    #: (atoms,) ≥ 0, summing to the number of module groups: 1 on every group of one channel is that channel
    weights: np.ndarray
    #: the channel the shrink pulls toward
    prior: str
    #: the shrink strength chosen by inner cross-validation (∞: the prior itself)
    shrink: float
    #: each module's group, as the bank it was fitted on had them: new adapters' atoms are built with these
    groups: Mapping[str, str] = field(default_factory=dict)

    def similarity(self, bank: Bank) -> np.ndarray:
        """(queries, gallery) Σ_a w_a F_a on a bank of the same atoms."""
        if bank.atoms != self.atoms:
            raise ValueError("the bank's atoms differ from the metric's: build both over the same modules and buckets")
        return np.tensordot(self.weights, bank.values, axes=1)

    def between(self, gallery: ModuleStack, queries: ModuleStack, chunk: int = 2048) -> np.ndarray:
        """(queries.size, gallery.size) the metric between two stacks: their atoms over the metric's module groups."""
        return self.similarity(bank_matrices(gallery, queries, chunk=chunk, groups=self.groups))

    def as_dict(self) -> dict[str, Any]:
        """As a checkpoint stores it (JSON); `from_dict` reads it back."""
        return {
            "objective": self.objective,
            "atoms": [list(a) for a in self.atoms],
            "weights": self.weights.tolist(),
            "prior": self.prior,
            "shrink": None if math.isinf(self.shrink) else self.shrink,
            "groups": dict(self.groups),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ChannelMetric:
        atoms = tuple((str(c), str(g)) for c, g in d["atoms"])
        weights = np.asarray(d["weights"], dtype=np.float64)
        if len(weights) != len(atoms) or not (weights >= 0).all() or d["objective"] not in OBJECTIVES:
            raise ValueError("a channel metric needs an objective of OBJECTIVES and one non-negative weight per atom")
        shrink = math.inf if d["shrink"] is None else float(d["shrink"])
        return cls(str(d["objective"]), atoms, weights, str(d["prior"]), shrink, {str(k): str(v) for k, v in d["groups"].items()})

    def channel_shares(self) -> dict[str, float]:
        """Per channel its share of the weights (summing to 1)."""
        total = float(self.weights.sum())
        out: dict[str, float] = {}
        for (c, _), w in zip(self.atoms, self.weights, strict=True):
            out[c] = out.get(c, 0.0) + float(w) / total
        return out


def prior_metric(bank: Bank, channel: str, objective: str) -> ChannelMetric:
    """The metric that is one channel exactly: weight 1 on each of its groups."""
    groups = len(bank.groups)
    weights = np.array([1.0 if c == channel else 0.0 for c, _ in bank.atoms])
    if weights.sum() != groups:
        raise ValueError(f"channel {channel!r} needs one atom per module group of the bank")
    return ChannelMetric(objective, bank.atoms, weights, channel, math.inf, bank.modules)


def fit_metric(
    bank: Bank, targets: Sequence[str] | np.ndarray, objective: str, shrinks: Sequence[float] = SHRINKS, folds: int = FOLDS
) -> ChannelMetric:
    """The metric fitted on labelled adapters: `bank` is labelled × labelled (the same adapters in the same order on
    both sides), `targets` their tasks ("search", "task") or target values ("performance"); the shrink chosen from
    `shrinks` by `folds`-fold cross-validation (one value: no cross-validation)."""
    from threadpoolctl import threadpool_limits  # scipy and threadpoolctl: imported where a metric is fitted, not served

    problem = _Problem.of(bank, targets, objective)
    if not shrinks:
        raise ValueError("give at least one shrink strength")
    # one BLAS thread: the products are matrix-vector ones of a few MB, and on a busy machine a second thread waiting
    # for a descheduled one made a fit ten times slower (as in zoo/services/relations.py)
    with threadpool_limits(limits=1, user_api="blas"):
        chosen = shrinks[0] if len(shrinks) == 1 else _choose_shrink(problem, shrinks, folds)
        return problem.fit(chosen)


# -- the fit ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Problem:
    """A bank between labelled adapters with their targets, for one objective."""

    bank: Bank
    targets: np.ndarray
    objective: str

    @classmethod
    def of(cls, bank: Bank, targets: Sequence[str] | np.ndarray, objective: str) -> _Problem:
        if objective not in OBJECTIVES:
            raise ValueError(f"unknown objective {objective!r}; one of {OBJECTIVES}")
        n = bank.values.shape[1]
        if bank.values.shape[2] != n or len(targets) != n:
            raise ValueError(
                f"a fit needs a square bank over the labelled adapters and one target each: {bank.values.shape}, {len(targets)} targets"
            )
        if objective != "performance":
            return cls(bank, np.asarray(targets, dtype=object), objective)
        from scipy.stats import rankdata

        values = np.asarray(targets, dtype=np.float64)
        if not np.isfinite(values).all():
            raise ValueError("performance targets must be finite numbers")
        return cls(bank, rankdata(values) / len(values), objective)  # ranks: what a Spearman correlation scores

    def fit(self, shrink: float) -> ChannelMetric:
        """The metric fitted on every labelled adapter at one shrink strength."""
        setup = self.setup(np.arange(len(self.targets)))
        prior = prior_metric(self.bank, setup.prior, self.objective)
        if math.isinf(shrink):
            return prior
        active = setup.scale > _CONSTANT
        # an atom constant over the labelled pairs says nothing to the fit: it keeps the prior's weight
        weights = np.where(active, setup.solve(shrink) / np.where(active, setup.scale, 1.0), prior.weights * setup.temperature)
        if not weights.sum() > 0:
            return prior
        return ChannelMetric(
            self.objective, self.bank.atoms, weights * len(self.bank.groups) / weights.sum(), setup.prior, shrink, self.bank.modules
        )

    def setup(self, rows: np.ndarray) -> _Setup:
        """The fit on `rows`: the standardized atoms' loss and the prior there."""
        from scipy.optimize import minimize_scalar

        X = self.bank.values[:, rows[:, None], rows[None, :]]
        valid = ~np.eye(len(rows), dtype=bool)
        scale = X[:, valid].std(axis=1)
        spread = self._spread(rows)
        loss = _Loss(_standardized(X, scale), self.targets[rows], self.targets[rows], valid, self.objective, spread)
        best: tuple[float, str, float] | None = None
        for channel in self.bank.channels:
            direction = _direction(self.bank.atoms, channel, scale)
            if not direction.any():
                continue
            scores = np.tensordot(direction, loss.X, axes=1)
            found = minimize_scalar(
                lambda t, s=scores: loss.at_scores(math.exp(t) * s, gradient=False)[0],
                bounds=_LOG_TEMPERATURE,
                method="bounded",
                options={"xatol": 1e-3},
            )
            criterion = -_knn_spearman(scores, self.targets[rows], self.targets[rows]) if self.objective == "performance" else found.fun
            if best is None or criterion < best[0]:
                best = (float(criterion), channel, math.exp(float(found.x)))
        if best is None:
            raise ValueError("no atom of the bank varies over the labelled adapters")
        _, prior, temperature = best
        return _Setup(rows, scale, spread, loss, prior, temperature, temperature * _direction(self.bank.atoms, prior, scale))

    def _spread(self, rows: np.ndarray) -> float:
        """The targets' variance over the rows (performance), which makes its loss unitless."""
        if self.objective != "performance":
            return 1.0
        return max(float(np.var(self.targets[rows].astype(np.float64))), 1e-12)

    def heldout(self, setups: list[tuple[_Setup, np.ndarray]], shrink: float) -> float:
        """The held-out criterion (lower is better) of a shrink: each setup's metric scores its test rows against its
        rows; the mean loss over the test anchors, or for performance minus the Spearman correlation of the 10-NN
        predictions pooled over the setups (the kernel regression's loss picks channels that a 10-NN serves worse)."""
        total, anchors, guesses, truths = 0.0, 0, [], []
        for setup, test in setups:
            Xs = _standardized(self.bank.values[:, test[:, None], setup.rows[None, :]], setup.scale)
            v = setup.solve(shrink)
            if self.objective == "performance":
                guesses.append(_knn_mean(np.tensordot(v, Xs, axes=1), self.targets[setup.rows]))
                truths.append(self.targets[test])
                continue
            valid = np.ones((len(test), len(setup.rows)), dtype=bool)
            loss = _Loss(Xs, self.targets[test], self.targets[setup.rows], valid, self.objective, setup.spread)
            total, anchors = total + loss(v)[0] * loss.anchors, anchors + loss.anchors
        if self.objective == "performance":
            return -_spearman(np.concatenate(guesses), np.concatenate(truths))
        return total / max(anchors, 1)


@dataclass(frozen=True)
class _Setup:
    """A fit's rows, its atoms' spreads and target spread, its loss over the standardized atoms, and the prior: its
    channel, inverse temperature β and standardized weights v₀."""

    rows: np.ndarray
    scale: np.ndarray
    spread: float
    loss: _Loss
    prior: str
    temperature: float
    v0: np.ndarray

    def solve(self, shrink: float) -> np.ndarray:
        """The standardized weights v ≥ 0 minimizing loss(v) + shrink·‖v − v₀‖² / ‖v₀‖² (v₀ at shrink ∞)."""
        from scipy.optimize import minimize

        if math.isinf(shrink):
            return self.v0
        v0, norm = self.v0, float(self.v0 @ self.v0)

        def objective(v: np.ndarray) -> tuple[float, np.ndarray]:
            value, grad = self.loss(v)
            d = v - v0
            return value + shrink * float(d @ d) / norm, grad + 2 * shrink * d / norm

        bounds = [(0.0, None) if a > _CONSTANT else (0.0, 0.0) for a in self.scale]
        found = minimize(objective, v0, jac=True, method="L-BFGS-B", bounds=bounds, options={"maxiter": 500})
        return np.maximum(found.x, 0.0)


def _direction(atoms: tuple[tuple[str, str], ...], channel: str, scale: np.ndarray) -> np.ndarray:
    """One channel's standardized weights at β = 1: its atoms' spreads (0 for an atom constant over the pairs)."""
    return np.array([s if c == channel and s > _CONSTANT else 0.0 for (c, _), s in zip(atoms, scale, strict=True)])


def _standardized(X: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The atoms divided by their spreads; 0 for an atom constant over the fit's pairs."""
    active = scale > _CONSTANT
    return np.where(active[:, None, None], X / np.where(active, scale, 1.0)[:, None, None], 0.0)


def _choose_shrink(problem: _Problem, shrinks: Sequence[float], folds: int) -> float:
    """The shrink of least held-out criterion (`_Problem.heldout`) over `folds` folds (stratified by task, else by
    target rank); ties go to the stronger shrink."""
    fold = _folds(problem.targets, problem.objective, folds)
    splits = [(np.flatnonzero(fold != k), np.flatnonzero(fold == k)) for k in range(folds)]
    setups = [(problem.setup(train), test) for train, test in splits if len(test) and len(train) > 1]
    best: tuple[float, float] | None = None
    for shrink in sorted(shrinks, reverse=True):
        criterion = problem.heldout(setups, shrink)
        if best is None or criterion < best[0] - 1e-12:
            best = (criterion, shrink)
    assert best is not None
    return best[1]


def _knn_mean(scores: np.ndarray, values: np.ndarray, k: int = KNN_K) -> np.ndarray:
    """Per row of scores (anchors, candidates; -inf: not a candidate) the mean value of its k best-scored candidates,
    weighted by max(score, 0) + 1e-6: the similarity-weighted kNN regression that embed.selection.metrics.knn_regress serves."""
    k = min(k, scores.shape[1])
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    weights = np.maximum(np.take_along_axis(scores, top, axis=1), 0.0) + 1e-6
    return (weights * values[top]).sum(axis=1) / weights.sum(axis=1)


def _knn_spearman(scores: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> float:
    """The Spearman correlation of the kNN regression of the columns' values with the rows' own, leaving each row out
    of its own neighbours where rows and columns are the same adapters (a square score matrix)."""
    s = scores.copy()
    if s.shape[0] == s.shape[1]:
        np.fill_diagonal(s, -np.inf)
    return _spearman(_knn_mean(s, cols), rows)


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's correlation, 0 where either side is constant."""
    from scipy.stats import spearmanr

    value = float(spearmanr(a, b).statistic)
    return value if math.isfinite(value) else 0.0


def _folds(targets: np.ndarray, objective: str, folds: int) -> np.ndarray:
    """Each row's fold: per task its members dealt in turn (search, task), else the rows dealt in turn by target
    rank (performance), so that every fold spans the targets."""
    if folds < 2:
        raise ValueError("inner cross-validation needs at least 2 folds")
    out = np.zeros(len(targets), dtype=np.int64)
    if objective == "performance":
        out[np.argsort(targets.astype(np.float64), kind="stable")] = np.arange(len(targets)) % folds
        return out
    seen: dict[object, int] = {}
    for i, t in enumerate(targets.tolist()):
        out[i] = seen.get(t, 0) % folds
        seen[t] = seen.get(t, 0) + 1
    return out


class _Loss:
    """An objective's mean loss over the anchors with a gradient in v, for s = Σ_a v_a X_a between anchors (rows)
    and candidates (columns); `valid` marks the pairs that count (not an anchor with itself)."""

    def __init__(self, X: np.ndarray, rows: np.ndarray, cols: np.ndarray, valid: np.ndarray, objective: str, spread: float) -> None:
        self.X, self.valid, self.objective, self.spread = X, valid, objective, spread
        if objective == "performance":
            self.rows, self.cols = rows.astype(np.float64), cols.astype(np.float64)
            self.keep = valid.any(axis=1)
        else:
            self.positive = (rows[:, None] == cols[None, :]) & valid
            self.keep = self.positive.any(axis=1)  # an anchor with no other of its task says nothing
        self.anchors = int(self.keep.sum())

    def __call__(self, v: np.ndarray) -> tuple[float, np.ndarray]:
        """The loss at s = Σ_a v_a X_a and its gradient in v."""
        value, d_s = self.at_scores(np.tensordot(v, self.X, axes=1))
        return value, self.X.reshape(len(v), -1) @ d_s.ravel()

    def at_scores(self, scores: np.ndarray, gradient: bool = True) -> tuple[float, np.ndarray]:
        """The loss at scores s (anchors, candidates) and, with `gradient`, its gradient in s (else zeros)."""
        d_full = np.zeros(self.valid.shape)
        if not self.anchors:
            return 0.0, d_full
        s = np.where(self.valid, scores, -np.inf)[self.keep]
        log_z = _logsumexp_rows(s)
        log_p = s - log_z
        p = np.exp(log_p)
        if self.objective == "performance":
            guess = p @ self.cols
            error = guess - self.rows[self.keep]
            value = float((error**2).mean()) / self.spread
            if gradient:
                d_s = 2 * error[:, None] * p * (self.cols[None, :] - guess[:, None]) / (self.anchors * self.spread)
        else:
            positive = self.positive[self.keep]
            if self.objective == "task":
                on_task = np.where(positive, s, -np.inf)
                log_mass = _logsumexp_rows(on_task)
                value = float(-(log_mass[:, 0] - log_z[:, 0]).mean())
                if gradient:
                    d_s = (p - np.where(positive, np.exp(on_task - log_mass), 0.0)) / self.anchors
            else:
                share = positive / positive.sum(axis=1, keepdims=True)
                value = float(-(np.where(positive, log_p, 0.0) * share).sum(axis=1).mean())
                if gradient:
                    d_s = (p - share) / self.anchors
        if gradient:
            d_full[self.keep] = np.where(self.valid[self.keep], d_s, 0.0)
        return value, d_full


def _logsumexp_rows(a: np.ndarray) -> np.ndarray:
    """logsumexp over the rows of a 2-D array, kept 2-D, by torch (scipy.special.logsumexp's array-API dispatch cost three
    times the sum at the loss's sizes, tens of thousands of calls a W2T training)."""
    import torch

    return torch.logsumexp(torch.from_numpy(a), dim=1, keepdim=True).numpy()
