"""Merges PEFT makes factor by factor, read from the raw factors entry by entry.

PEFT's `add_weighted_adapter` with `linear`, `magnitude_prune`, `ties`, `dare_linear` or `dare_ties` combines the
parents' A matrices entry by entry, and their B matrices the same way, each parent i weighted by c_i = √(w_i·s_i)
(its weight times its LoRA scaling): for every entry e of a factor,

    sum models:   X_q[e] = Σ_{i ∈ K_e} c'_i·X_i[e]
    ties models:  X_q[e] = Σ_{i ∈ T_e} c'_i·X_i[e] / |T_e|

where K_e is the set of parents that kept the entry (all of them for `linear`; the top-density share by magnitude
of each parent's factor for `magnitude_prune` and `ties`; a random draw for `dare_*`, which also rescales:
c'_i = c_i / density) and T_e the members of K_e whose sign is the sign of Σ_{i ∈ K_e} X_i[e] (TIES' sign election,
on the unweighted factors). The pruning is applied to A and B in their own gauge, so the canonical dW of the
merge is no sum of its parents' and the fits in dW space (zoo/domain/merges.py) miss it (residual 0.2-1.0 on the
lineage recipe). In the raw factors the model is exact, and every factorwise merge is found by one fit: the c' and,
per entry, which parents kept it (at most 2³ choices), alternated until they agree. Which kind of pruning made the
kept sets is then read off them: by magnitude when the kept entries of each parent are its largest.

The raw factors of a stored adapter are its canonical factors in the gauge of its file (`RawModule`: B = U·M,
A = N·Vᵀ, two r×r matrices a module, kept at ingest). Only a sample of the entries is read, the same positions in
every adapter (SAMPLE_ENTRIES, spread over the modules), so the cost does not grow with the adapter's size.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import nnls

#: entries of the raw factors read per adapter (the same positions in each), spread over the modules
SAMPLE_ENTRIES = 8192
#: entries of that sample the candidate parent sets are screened on before the best is fitted on all of it
SCREEN_ENTRIES = 512
#: entries of the screen every set is fitted on first (`_near`): most sets fit no better than a few tenths (siblings
#: that share half their factors are the usual candidates), which these tell at an eighth of the cost
SCREEN_FIRST = 64
#: the sets that fit those entries best are screened on all of them whatever their residual there (so few entries can
#: hold a true set's fit in a local optimum a little above HOPELESS)
SCREEN_KEPT = 4
#: candidates whose pairs are tried as parents (see `_likely_parents`)
TRIED = 8
#: a fit that leaves out at most this share of the entries it can tell is a merge of everything (`linear`): a bf16
#: copy's rounding moves a few entries to another kept set
ALL_KEPT = 0.01
#: ratios of the query's entries to a candidate's are one number when they agree within this (relative)
ALONE_RTOL = 1e-4
#: the least share of entries with one ratio for that ranking (unrelated: about 1/entries; a 3-parent merge at
#: density 0.9 on the lineage recipe: 0.01-0.02)
MIN_ALONE = 0.005
#: a plain non-negative fit over all candidates within this is worth the subsets' fits too (a linear merge's is exact)
LINEAR_RTOL = 0.01
#: where no pair fits: every triple of the first TRIPLES_FROM likely parents, and the EXTENDED best-fitting pairs each
#: with every third (a 3-parent merge's pairs of two true parents fit better than the others)
TRIPLES_FROM = 6
EXTENDED = 3
#: the least raw-factor cosine of a parent with the query (a parent kept at density d with an equal partner: √(d/2);
#: unrelated adapters' factors, from independent inits: ~1/√entries)
MIN_RAW_COSINE = 0.03
#: alternations of the fit (kept sets, then weights) at most
MAX_ROUNDS = 20
#: after this many alternations, a fit whose relative residual is above HOPELESS is given up
ROUNDS_TO_TELL = 6
HOPELESS = 0.1
#: a share of kept entries ordered by magnitude at least this well (ROC AUC of |X_i| between kept and pruned
#: entries) is magnitude pruning; random pruning gives ~0.5
MAGNITUDE_AUC = 0.9
#: a parent's term in an entry tells whether it was kept when it is at least this share of the entries' RMS
DECIDABLE = 1e-3
#: relative residual of a fit from the float32 rounding of the stored factors: a set of parents with one member less
#: that fits this well is preferred
FLOAT_RTOL = 1e-4


@dataclass(frozen=True)
class RawModule:
    """One module of an adapter as the fit reads it (float64): canonical U, S, V and their gauge, B = U·M and A = N·Vᵀ
    as its file had them, so M·N = S / s (kept only where the update has the factors' full rank)."""

    U: np.ndarray  # (out, k)
    S: np.ndarray  # (k,)
    V: np.ndarray  # (in, k)
    M: np.ndarray  # (k, r): Uᵀ·B
    N: np.ndarray  # (r, k): A·V
    #: `_sampled` of the adapter whose first module this is, by the id of the positions read
    _sampled: dict[int, tuple[Positions, tuple[np.ndarray, np.ndarray, np.ndarray]]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    @property
    def scale(self) -> float:
        """s, the module's LoRA scaling (S = s·M·N)."""
        core = np.einsum("ij,ji->i", self.M, self.N)
        return float(np.median(self.S / np.where(core == 0, np.inf, core)))

    @property
    def shape(self) -> tuple[int, int, int]:
        """(out, in, the factors' rank): modules of one shape are read at the same entries."""
        return int(self.U.shape[0]), int(self.V.shape[0]), int(self.N.shape[0])


@dataclass(frozen=True)
class Positions:
    """Which entries of each module are read: rows of B and columns of A."""

    b_rows: Mapping[str, np.ndarray]
    a_cols: Mapping[str, np.ndarray]


@dataclass(frozen=True)
class FactorwiseFit:
    """The query's raw factors as PEFT's `combination` of `members` (indices of the candidates) with PEFT's `weights`."""

    members: tuple[int, ...]
    weights: tuple[float, ...]
    combination: str  # linear | magnitude_prune | ties | dare_linear | dare_ties
    density: float
    rho: float  # relative residual on the sampled entries
    magnitude_auc: float
    entries: int


def positions(shapes: Mapping[str, tuple[int, int, int]], budget: int = SAMPLE_ENTRIES) -> Positions:
    """The entries read of modules of these (out, in, rank) shapes: as many rows of B and columns of A per module as
    the budget spreads evenly (at least one each), drawn by a fixed generator so every adapter is read at the same."""
    rng = np.random.default_rng(0)
    per_factor = max(1, budget // max(1, 2 * len(shapes)))
    b_rows, a_cols = {}, {}
    for name in sorted(shapes):
        out, inp, r = shapes[name]
        count = max(1, per_factor // max(1, r))
        b_rows[name] = np.sort(rng.choice(out, size=min(out, count), replace=False))
        a_cols[name] = np.sort(rng.choice(inp, size=min(inp, count), replace=False))
    return Positions(b_rows, a_cols)


def sampled(modules: Mapping[str, RawModule], where: Positions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the raw entries at `where`, each entry's magnitude in units of its factor's RMS, each entry's factor: 2·module
    for B, 2·module + 1 for A) of one adapter, in one order."""
    values, scaled, factor = [], [], []
    for k, name in enumerate(sorted(where.b_rows)):
        m = modules[name]
        b = m.U[where.b_rows[name]] @ m.M  # rows of B
        a = m.N @ m.V[where.a_cols[name]].T  # columns of A
        b_rms = np.linalg.norm(m.M) / math.sqrt(m.U.shape[0] * m.M.shape[1])  # ‖B‖ = ‖M‖ (U orthonormal)
        a_rms = np.linalg.norm(m.N) / math.sqrt(m.V.shape[0] * m.N.shape[0])
        values += [b.ravel(), a.ravel()]
        scaled += [np.abs(b.ravel()) / max(b_rms, 1e-300), np.abs(a.ravel()) / max(a_rms, 1e-300)]
        factor += [np.full(b.size, 2 * k), np.full(a.size, 2 * k + 1)]
    return np.concatenate(values), np.concatenate(scaled), np.concatenate(factor)


@functools.lru_cache(maxsize=8)
def _positions(shapes: tuple[tuple[str, tuple[int, int, int]], ...]) -> Positions:
    """`positions` made once per structure: `_sampled` keeps an adapter's sample by its positions."""
    return positions(dict(shapes))


def _sampled(modules: Mapping[str, RawModule], where: Positions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`sampled`, made once per adapter and positions (an adapter is a candidate of many queries in the relation step:
    a fifth of the step's factorwise time at SDXL's 418 modules). Kept on the adapter's first module with the positions
    it was read at (held, so that their id is not reused)."""
    first = modules[min(modules)]
    known = first._sampled.get(id(where))
    if known is None or known[0] is not where:
        known = first._sampled[id(where)] = (where, sampled(modules, where))
    return known[1]


def fit_factorwise(query: Mapping[str, RawModule], candidates: Sequence[Mapping[str, RawModule] | None]) -> FactorwiseFit | None:
    """The best factorwise merge of the query from 2-3 of the candidates (None where a candidate has no gauge or
    another structure), or None when no set of them is worth fitting."""
    shapes = {n: m.shape for n, m in query.items()}
    usable = [i for i, c in enumerate(candidates) if c is not None and _same_raw_shapes(c, shapes)]
    if len(usable) < 2:
        return None
    where = _positions(tuple(sorted(shapes.items())))
    y, _, factor = _sampled(query, where)
    cols = [_sampled(candidates[i], where) for i in usable]  # type: ignore[arg-type]
    X = np.stack([c[0] for c in cols], axis=1)
    mags = np.stack([c[1] for c in cols], axis=1)
    kept = _first_of_parallel(X)
    X, mags, usable = X[:, kept], mags[:, kept], [usable[k] for k in kept]
    yy = float(y @ y)
    if yy == 0.0:
        return None
    likely = _likely_parents(y, X)
    if len(likely) < 2:
        return None
    part = slice(0, None, max(1, len(y) // SCREEN_ENTRIES))
    tried = screen(y[part], X[part], list(itertools.combinations(likely, 2)))
    if not tried or tried[0][0] > FLOAT_RTOL:  # no pair fits exactly: a third parent may be needed
        triples: set[tuple[int, ...]] = set(itertools.combinations(sorted(likely[:TRIPLES_FROM]), 3))
        for _, pair, *_ in tried[:EXTENDED]:
            triples |= {tuple(sorted((*pair, k))) for k in likely if k not in pair}
        tried = sorted(tried + screen(y[part], X[part], sorted(triples)), key=lambda t: t[0])
    if not tried or tried[0][0] > HOPELESS:  # no set comes near on the screen: none is exact on the whole sample
        return None
    _, subset, c, ties = _first_stored(tried)
    (rho,), (c,), (chosen,) = _alternate(y, _design(X[:, subset][None], ties), c[None])
    parents = [candidates[usable[k]] for k in subset]
    chosen = _SETS[len(subset)][chosen] & (X[:, subset] != 0)
    return _described(y, X[:, subset], float(rho), c, chosen, ties, mags[:, subset], factor, parents, [usable[k] for k in subset])


def _first_stored(tried: list[tuple[float, tuple[int, ...], np.ndarray, bool]]) -> tuple[float, tuple[int, ...], np.ndarray, bool]:
    """The best fit, but of the sets that fit as well (within twice its residual, or exactly) the first-stored (the
    candidates come in stored order): a magnitude-pruned copy of a parent explains a merge pruned at a lower density
    exactly as the parent does, since both keep the same largest entries."""
    bar = max(2 * tried[0][0], FLOAT_RTOL)
    fewest = min(len(t[1]) for t in tried if t[0] <= bar)
    return min((t for t in tried if t[0] <= bar and len(t[1]) == fewest), key=lambda t: sorted(t[1]))


def _first_of_parallel(X: np.ndarray) -> list[int]:
    """The columns of X but those parallel to an earlier one (copies with the same factors, e.g. alpha changed): any of
    them fits as well, and the first (the candidates come in stored order) is named."""
    unit = X / np.maximum(np.linalg.norm(X, axis=0), 1e-300)
    kept: list[int] = []
    for k in range(X.shape[1]):
        if not kept or np.max(np.abs(unit[:, kept].T @ unit[:, k])) < 1.0 - FLOAT_RTOL:
            kept.append(k)
    return kept


def _likely_parents(y: np.ndarray, X: np.ndarray) -> list[int]:
    """Up to TRIED candidates (of at least MIN_RAW_COSINE), taken by turns from rankings: by the share of the query's
    entries that are one multiple of theirs (`_alone_share`), by their share of a non-negative fit of the query over all
    of them, by that share once the first or second of that ranking is left out, and by raw cosine with the query. A
    sibling merge of the same parents, or a continuation of one, shares most of the query's factors and takes the whole
    fit: without it, the parents do. None when the query looks like no factorwise merge of them: no candidate's
    multiple makes MIN_ALONE of its entries (a pruning merge's entries kept by one parent only) and the fit over all
    leaves more than LINEAR_RTOL (a linear merge, which keeps every entry)."""
    norms = np.sqrt(np.maximum((X * X).sum(axis=0), 1e-300))
    cos = (X.T @ y) / (norms * math.sqrt(float(y @ y)))
    allowed = cos >= MIN_RAW_COSINE
    alone = _alone_share(y, X)
    by_alone = [int(k) for k in np.argsort(-alone) if allowed[k] and alone[k] >= MIN_ALONE]

    def by_share(left_out: int | None) -> tuple[list[int], float]:
        cols = [k for k in range(X.shape[1]) if allowed[k] and k != left_out]
        if not cols:
            return [], 1.0
        w, residual = nnls(X[:, cols], y)
        share = w * norms[cols]
        return [cols[j] for j in np.argsort(-share) if share[j] > 0], residual / math.sqrt(float(y @ y))

    first, residual = by_share(None)
    if not by_alone and residual > LINEAR_RTOL:
        return []
    rankings = [by_alone, first, *(by_share(k)[0] for k in first[:2]), [int(k) for k in np.argsort(-cos) if allowed[k]]]
    out: list[int] = []
    for k in itertools.chain.from_iterable(itertools.zip_longest(*rankings)):
        if k is not None and k not in out:
            out.append(k)
    return out[:TRIED]


def _alone_share(y: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Per candidate, the largest share of the entries whose ratio to the query is one number: where a pruned merge
    kept an entry of one parent only, the query's entry is c'_i times that parent's (about d(1 - d) of the entries for
    two parents at density d); an unrelated candidate's ratios are all different."""
    out = np.zeros(X.shape[1])
    floor = ALONE_RTOL * math.sqrt(float(y @ y) / len(y))
    for k in range(X.shape[1]):
        told = (np.abs(X[:, k]) > floor) & (np.abs(y) > floor)
        if told.any():
            ratio = y[told] / X[told, k]
            key = np.round(np.log(np.abs(ratio)) / ALONE_RTOL) * np.sign(ratio)
            out[k] = np.unique(key, return_counts=True)[1].max() / len(y)
    return out


def _same_raw_shapes(c: Mapping[str, RawModule], shapes: Mapping[str, tuple[int, int, int]]) -> bool:
    return all(n in c and c[n].shape == s for n, s in shapes.items())


def screen(y: np.ndarray, X: np.ndarray, subsets: list[tuple[int, ...]]) -> list[tuple[float, tuple[int, ...], np.ndarray, bool]]:
    """(residual, subset, c', ties?) of the subsets (all of one size) whose plain least-squares weights are all
    positive and that come near on a few of the entries (`_near`), each by the better of the sum and ties models from
    two starts (the least-squares weights, and those over a random draw's keep rate read from the query's non-zero
    entries, which dare's rescaling wants), all subsets fitted at once; best first."""
    if not subsets:
        return []
    S = np.array(subsets)
    Xs = np.ascontiguousarray(X[:, S].transpose(1, 0, 2))  # (subsets, entries, parents)
    c0 = _least_squares(Xs, y)
    ok = np.all(c0 > 0, axis=1)
    if not ok.any():
        return []
    S, Xs, c0 = S[ok], Xs[ok], c0[ok]
    support = np.any(Xs != 0, axis=2)
    union = np.clip((support & (y != 0)).sum(axis=1) / np.maximum(support.sum(axis=1), 1), 0.0, 1.0 - 1e-9)
    density = np.maximum(1.0 - (1.0 - union) ** (1.0 / S.shape[1]), 1e-3)
    near = _near(y, Xs, c0, density)
    S, best, fits = S[near], *_fits(y, Xs[near], c0[near], density[near])
    out = [(float(best[p]), tuple(int(k) for k in S[p]), *fit) for p, fit in enumerate(fits) if fit is not None]
    return sorted(out, key=lambda t: t[0])


def _near(y: np.ndarray, Xs: np.ndarray, c0: np.ndarray, density: np.ndarray) -> np.ndarray:
    """Which subsets are worth fitting on all the entries: those that fit SCREEN_FIRST of them (evenly spread) within
    HOPELESS, and the SCREEN_KEPT that fit them best."""
    first = slice(0, None, max(1, len(y) // SCREEN_FIRST))
    rough = _fits(y[first], Xs[:, first], c0, density)[0]
    return (rough <= HOPELESS) | (np.argsort(np.argsort(rough, kind="stable")) < SCREEN_KEPT)


def _fits(y: np.ndarray, Xs: np.ndarray, c0: np.ndarray, density: np.ndarray) -> tuple[np.ndarray, list[tuple[np.ndarray, bool] | None]]:
    """Per subset (Xs: subsets × entries × parents), the least relative residual of the sum and ties models from the
    two starts, and its (c', ties?)."""
    best = np.full(len(Xs), np.inf)
    fits: list[tuple[np.ndarray, bool] | None] = [None] * len(Xs)
    for ties in (False, True):
        D = _design(Xs, ties)
        for start in (c0, c0 / density[:, None]):
            rho, c, _ = _alternate(y, D, start.copy())
            for p in np.flatnonzero(rho < best):
                best[p], fits[p] = rho[p], (c[p], ties)
    return best, fits


def _least_squares(Xs: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin_c ‖Xs[p]·c - y‖ for each p (normal equations, a relative ridge of 1e-12 for the rank-deficient)."""
    Xt = Xs.transpose(0, 2, 1)
    G = Xt @ Xs  # batched BLAS products: half an einsum's time at these sizes (its path is planned every call)
    ridge = 1e-12 * np.maximum(np.trace(G, axis1=1, axis2=2), 1e-300)[:, None, None] * np.eye(G.shape[1])
    return np.linalg.solve(G + ridge, (Xt @ y)[..., None])[..., 0]


_SETS = {n: np.array(list(itertools.product((False, True), repeat=n)), dtype=bool) for n in (2, 3)}


def _design(Xs: np.ndarray, ties: bool) -> np.ndarray:
    """Per subset, entry and kept set (subsets × entries × sets × parents): each c'_i's coefficient in the value."""
    sets = _SETS[Xs.shape[2]]
    kept = sets[None, None, :, :] & (Xs[:, :, None, :] != 0)
    D = np.where(kept, Xs[:, :, None, :], 0.0)
    if ties:
        majority = np.where(D.sum(axis=3, keepdims=True) >= 0, 1.0, -1.0)
        agree = kept & (np.sign(Xs[:, :, None, :]) == majority)
        D = np.where(agree, D, 0.0) / np.maximum(agree.sum(axis=3, keepdims=True), 1)
    return D


def _alternate(y: np.ndarray, D: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fit c' and the kept sets of every subset by turns (each entry takes the set whose value is nearest; then c' by
    least squares) until the sets stay: (relative residuals, c', the set picked per entry). A subset whose residual
    is above HOPELESS after ROUNDS_TO_TELL turns is given up (a fit that holds was within 0.02 by the third turn on
    the lineage recipe, and within HOPELESS by the sixth for dare at density 0.3; the others were 0.09 and up)."""
    P, E = D.shape[:2]
    norm = math.sqrt(float(y @ y))
    pick = np.zeros((P, E), dtype=np.int64)
    active = np.ones(P, dtype=bool)
    live = D  # D's subsets still fitted: copied out again only when one settles (a copy a turn cost a fifth of the fit)
    for done in range(1, MAX_ROUNDS + 1):
        new = np.argmin(np.abs(y[None, :, None] - np.einsum("peks,ps->pek", live, c[active], optimize=True)), axis=2)
        rows = np.take_along_axis(live, new[:, :, None, None], axis=2)[:, :, 0, :]
        c[active] = _least_squares(rows, y)
        settled = np.all(new == pick[active], axis=1)
        pick[active] = new
        if done == ROUNDS_TO_TELL:
            settled |= np.linalg.norm(y - np.einsum("pes,ps->pe", rows, c[active], optimize=True), axis=1) > HOPELESS * norm
        if settled.any():
            active[np.flatnonzero(active)[settled]] = False
            if not active.any():
                break
            live = D[active]
    rows = np.take_along_axis(D, pick[:, :, None, None], axis=2)[:, :, 0, :]
    return np.linalg.norm(y - np.einsum("pes,ps->pe", rows, c, optimize=True), axis=1) / norm, c, pick


def _described(
    y: np.ndarray,
    X: np.ndarray,
    rho: float,
    c: np.ndarray,
    kept: np.ndarray,
    ties: bool,
    mags: np.ndarray,
    factor: np.ndarray,
    parents: Sequence[Mapping[str, RawModule] | None],
    members: list[int],
) -> FactorwiseFit:
    """Name the combination from the kept sets and turn c' into PEFT's weights w_i = (c'_i·d)² / s_i.

    Only entries where a parent's term is large enough to tell are read: there the fit says whether it was kept (in
    the ties models: kept and of the elected sign) or pruned (in the ties models: left out though of the elected
    sign, the sign of the entry). By magnitude when its kept entries are its largest (ROC AUC); the density is then
    read per factor as the share of entries at least as large as the smallest kept one, else as the likeliest keep
    rate of a random draw (`_drawn_density`)."""
    told = np.abs(X * c) > DECIDABLE * math.sqrt(float(y @ y) / len(y))
    shown = _shown(kept, X) if ties else kept
    pruned = ~shown & told
    if ties:
        pruned &= (y == 0)[:, None] | (np.sign(X) == np.sign(y)[:, None])
    aucs = [_auc(mags[shown[:, i] & told[:, i], i], mags[pruned[:, i], i]) for i in range(X.shape[1])]
    auc = float(min(aucs))
    shown_told = int((shown & told).sum())
    if pruned.sum() <= ALL_KEPT * (shown_told + pruned.sum()):  # a few entries off by the rounding of a cast
        combination, rescale, density = ("ties" if ties else "linear"), 1.0, 1.0
    elif auc >= MAGNITUDE_AUC:
        combination, rescale = ("ties" if ties else "magnitude_prune"), 1.0
        density = _magnitude_density(mags, shown & told, factor)
    else:
        combination = "dare_ties" if ties else "dare_linear"
        density = rescale = _drawn_density(X[told.all(axis=1)], shown[told.all(axis=1)], ties)
    scales = [_adapter_scale(p) for p in parents]
    weights = tuple(float((ci * rescale) ** 2 / s) for ci, s in zip(c, scales, strict=True))
    return FactorwiseFit(tuple(members), weights, combination, density, rho, auc, len(y))


def _shown(kept: np.ndarray, X: np.ndarray) -> np.ndarray:
    """Of each entry's kept set, the members of the sign TIES elects (the sign of their unweighted sum): the only ones
    its value shows."""
    majority = np.where((np.where(kept, X, 0.0)).sum(axis=1, keepdims=True) >= 0, 1.0, -1.0)
    return kept & (np.sign(X) == majority)


def _drawn_density(X: np.ndarray, shown: np.ndarray, ties: bool) -> float:
    """The keep rate d of independent draws most likely to have shown these sets (entries where every parent's term
    can be told): an entry shows set A with probability Σ d^|K|·(1-d)^(n-|K|) over the kept sets K that show A (in
    the ties models, a member of K against the elected sign is not shown; else K = A). On a grid of 0.01."""
    if not len(X):
        return 1.0
    sets = _SETS[X.shape[1]]
    K = np.broadcast_to(sets[None], (len(X), *sets.shape))
    seen = np.stack([_shown(K[:, k], X) for k in range(len(sets))], axis=1) if ties else K & (X[:, None, :] != 0)
    match = np.all(seen == shown[:, None, :], axis=2)  # entries × kept sets
    size = sets.sum(axis=1)
    grid = np.linspace(0.01, 0.99, 99)
    prob = grid[:, None] ** size[None] * (1 - grid[:, None]) ** (X.shape[1] - size[None])  # grid × kept sets
    likelihood = np.log(np.maximum(match.astype(float) @ prob.T, 1e-300)).sum(axis=0)
    return float(grid[np.argmax(likelihood)])


def _magnitude_density(mags: np.ndarray, kept: np.ndarray, factor: np.ndarray) -> float:
    """The share of each parent's sampled entries at least as large as its smallest kept one in their factor."""
    above = total = 0
    for f in np.unique(factor):
        rows = factor == f
        for i in range(mags.shape[1]):
            if kept[rows, i].any():
                floor = mags[rows, i][kept[rows, i]].min()
                above += int((mags[rows, i] >= floor).sum())
                total += int(rows.sum())
    return above / total if total else 1.0


def _adapter_scale(modules: Mapping[str, RawModule] | None) -> float:
    assert modules is not None
    return float(np.median([m.scale for m in modules.values()]))


def _auc(kept: np.ndarray, pruned: np.ndarray) -> float:
    """P(a kept entry's magnitude > a pruned one's), 1 where there is nothing to compare."""
    if not len(kept) or not len(pruned):
        return 1.0
    both = np.concatenate([kept, pruned])
    ranks = np.empty(len(both))
    ranks[np.argsort(both, kind="stable")] = np.arange(1, len(both) + 1)
    return float((ranks[: len(kept)].sum() - len(kept) * (len(kept) + 1) / 2) / (len(kept) * len(pruned)))
