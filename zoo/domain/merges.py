"""Merges from the weights: which 2-3 of k candidate adapters a query adapter was merged from, with which weights
and, where the weights say it, by which of PEFT's `add_weighted_adapter` combinations.

Everything is read off per-module Gram matrices of the stacked canonical factors of the query and a pool of the
candidates most correlated with it (zoo/domain/lowrank.py): O(k) inner products to pick the pool, then O(pool²)
r×r blocks per module; no d_out × d_in matrix. Three exact hypotheses, each with non-negative weights
(scipy's NNLS) shared by all modules, as PEFT's weights are:

- `cat` (or a plain weighted sum): dW_q = Σ w_i dW_i, fitted in dW space. PEFT's `cat` concatenates the
  factors, so the query's rank is the parents' summed rank; a sum of lower rank is reported as `weighted_sum`;
- `svd`: dW_q is the best rank-r_q approximation of Σ w_i dW_i. Then U_qᵀ (Σ w_i dW_i) V_q = diag(S_q), a
  linear fit in the r_q × r_q projections that gives the weights; the top-r_q of the weighted sum is then
  compared with the query in full;
- `linear`: A_q = Σ √w_i A_i and B_q = Σ √w_i B_i (PEFT folds each parent's scaling into w_i), so dW_q =
  Σ_ij √(w_i w_j) B_i A_j: the query lies in the parents' joint column and row spaces, dW_q = 𝒰 C 𝒱ᵀ with
  𝒰 = [U_1 … U_n], and the diagonal blocks are exactly C_ii = w_i·diag(S_i) whatever the factors' gauge, so
  the canonical factors suffice (the subspaces must be independent: Σ r_i below the module's width).

A hypothesis holds when its relative residual is within the bf16 cast band (the merged adapter may have been
stored at that precision). When none holds, the better of the dW-space and svd fits is reported as `approximate`
if its residual is at most APPROXIMATE_RTOL: the sparsifying combinations (ties, dare_linear, dare_ties,
magnitude_prune and their _svd forms) perturb the weighted sum by their pruning, and their type is not told.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import nnls

from zoo.domain.factorwise import fit_factorwise
from zoo.domain.lowrank import GRAM_RTOL, LowRank, Stack, Stacks, inner, sq_norm
from zoo.domain.transforms import BAND_FACTOR, Update, expected_cast_residual, same_structure

#: candidates kept for the fits (the most correlated with the query): 12, as the relation step compares a query with
#: its module-sketch and raw-factor neighbours (zoo/services/relations.py)
MERGE_POOL = 12
#: candidates more than the pool that are stacked first, so that the copies dropped from them leave it full (a root's
#: rescaled and cast copies are as near as the root and took the slot of a merge's third parent on the lineage recipe)
POOL_MARGIN = 4
#: the most parents a merge is given
MAX_PARENTS = 3
#: candidates tried as parents of a `linear` merge (all their subsets of 2..MAX_PARENTS): the first 8 of the pool, since a
#: subset that does not fit is given up at its first modules (`_linear_fit`); with the 5 likeliest by the weighted sum's
#: fit, a linear merge's parents were left out behind other merges of them (the lineage recipe: 0 of 2 found). Where the
#: gauges are known, a linear merge is also the factorwise fit's (zoo/domain/factorwise.py), over all candidates
LINEAR_TRIED = 8
#: a parent whose share w_i·‖dW_i‖ / Σ_j w_j·‖dW_j‖ is below this is dropped
MIN_SHARE = 0.02
#: an exact hypothesis holds up to the rounding of a bf16 copy of the merged adapter
EXACT_RTOL = expected_cast_residual("bf16") * BAND_FACTOR
#: the largest residual of a merge reported as `approximate`
APPROXIMATE_RTOL = 0.35
#: the least share of the query's energy (‖dW_q‖²) each parent of an `approximate` merge must explain alone
#: (the rise of the dW-space fit's residual² without it): a continuation's noise picked up by another candidate is none
MIN_UNIQUE_ENERGY = 0.05


@dataclass(frozen=True)
class MergeEdge:
    """dW_query ≈ combination of the parents' dW with `weights` (PEFT's `add_weighted_adapter` weights)."""

    parents: tuple[int | None, ...]
    weights: tuple[float, ...]
    combination: str  # cat | weighted_sum | svd | linear | approximate
    confidence: float
    evidence: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Hypothesis:
    combination: str
    members: tuple[int, ...]  # indices into the pool
    weights: np.ndarray
    rho: float
    extra: dict[str, float] = field(default_factory=dict)


def detect_merge(
    query: Update, candidates: Sequence[Update], pool_size: int = MERGE_POOL, max_parents: int = MAX_PARENTS
) -> MergeEdge | None:
    """The merge the query was made by from 2..max_parents of the candidates, or None."""
    q = query.modules()
    comparable = [c for c in candidates if same_structure(query, c)]
    if not q or len(comparable) < 2:
        return None
    mods = [_aligned(c.modules(), q) for c in comparable]
    qq = sum(sq_norm(x) for x in q.values())
    cos = np.array([sum(inner(q[n], m[n]) for n in q) / math.sqrt(qq * max(sum(sq_norm(x) for x in m.values()), 1e-300)) for m in mods])
    pool = [int(i) for i in np.argsort(-cos)[: pool_size + POOL_MARGIN] if cos[i] > 0]
    if len(pool) < 2:
        return None
    stacks = Stacks([q, *(mods[i] for i in pool)], list(q))
    members = list(range(1, len(pool) + 1))
    G = stacks.gram(members)
    ids = [comparable[i].id for i in pool]
    copies = later_copies(G, ids) | later_sums(G, ids)
    copy_ids = {ids[k] for k in copies}
    if copies or len(pool) > pool_size:  # the pool without them, cut to its size, stacked again
        pool = [i for k, i in enumerate(pool) if k not in copies][:pool_size]
        if len(pool) < 2:
            return None
        stacks = Stacks([q, *(mods[i] for i in pool)], list(q))
        members = list(range(1, len(pool) + 1))
        G = stacks.gram(members)
    b = stacks.gram([0, *members])[0, 1:]
    summed = _weighted_sum(stacks, G, b, qq)
    # where every gauge is known, a linear merge is the factorwise fit's (over more candidates, and past the width)
    factorwise_linear = bool(query.raw_modules()) and all(len(c.raw_modules()) == len(query.raw_modules()) for c in comparable)
    svd_fit = _svd(stacks, len(pool))
    # its residual (the costly part: eigh and SVD of every module's blocks) only where the hypothesis can be chosen, or
    # told as evidence: a fit of more than max_parents is neither found nor exact, but named in a merge's evidence
    svd = _svd_hypothesis(stacks, *svd_fit, qq) if svd_fit is not None and 2 <= len(svd_fit[0]) <= max_parents else None
    hypotheses = [summed, svd, None if factorwise_linear else _linear(stacks, summed, max_parents, qq)]
    found = [h for h in hypotheses if h is not None and 2 <= len(h.members) <= max_parents]
    exact = [h for h in found if h.rho <= EXACT_RTOL]
    named = [comparable[i] for i in pool]  # what the hypotheses' members index
    factorwise = None if exact else _factorwise(query, comparable, copy_ids)
    if factorwise is not None:
        exact, named = [factorwise[0]], factorwise[1]
    if exact:  # a plain sum first (the simplest; linear and svd hold for it too), else the closest fit
        best = exact[0] if exact[0] is summed else min(exact, key=lambda h: h.rho)
        confidence = 1.0 - 0.5 * best.rho / EXACT_RTOL
    else:
        approx = [h for h in found if h.combination != "linear" and h.rho <= APPROXIMATE_RTOL]
        if not approx:
            return None
        best = min(approx, key=lambda h: h.rho)
        unique = _unique_energy(G, b, qq, list(best.members))
        if unique < MIN_UNIQUE_ENERGY:
            return None
        best = _Hypothesis("approximate", best.members, best.weights, best.rho, {**best.extra, "least_unique_energy": unique})
        confidence = 0.5 * (1.0 - best.rho / APPROXIMATE_RTOL)
    if hypotheses[1] is None and svd_fit is not None:
        hypotheses[1] = _svd_hypothesis(stacks, *svd_fit, qq)
    return MergeEdge(
        parents=tuple(named[i].id for i in best.members),
        weights=tuple(float(w) for w in best.weights),
        combination=best.combination,
        confidence=float(confidence),
        evidence={
            "relative_residual": best.rho,
            **{f"{kind}_residual": h.rho for kind, h in zip(("sum", "svd", "linear"), hypotheses, strict=True) if h is not None},
            **best.extra,
        },
    )


def _factorwise(query: Update, candidates: Sequence[Update], copies: set[int | None]) -> tuple[_Hypothesis, list[Update]] | None:
    """The exact factorwise merge (zoo/domain/factorwise.py) of the query from the candidates whose gauges are known,
    with the candidates its members index (in stored order, so that of parallel copies the first-stored is named). All
    candidates but the pool's later copies: the pool keeps those whose dW points the query's way, and a sparsified
    parent's may not."""
    q = query.raw_modules()
    if not q:
        return None
    named = sorted((c for c in candidates if c.id is None or c.id not in copies), key=lambda c: (c.id is None, c.id or 0))
    fit = fit_factorwise(q, [c.raw_modules() or None for c in named])
    if fit is None or fit.rho > EXACT_RTOL:
        return None
    extra = {"density": fit.density, "magnitude_auc": fit.magnitude_auc, "sampled_entries": float(fit.entries)}
    return _Hypothesis(fit.combination, fit.members, np.array(fit.weights), fit.rho, extra), named


def later_copies(G: np.ndarray, ids: Sequence[int | None]) -> set[int]:
    """Indices of the updates (G their Gram, ids their adapter ids) that are copies (parallel within the exact band:
    rescaled, cast) of another stored before them (a lower id; None last): a merge of one is as exact a merge of the
    other, so the parent named is the first stored, as for the undirected copies themselves."""
    d = np.sqrt(np.maximum(np.diag(G), 1e-300))
    cosine = G / np.outer(d, d)
    order = _stored_order(ids)
    later: set[int] = set()
    for pos, k in enumerate(order):
        if k not in later:
            later |= {j for j in order[pos + 1 :] if 1.0 - cosine[k, j] <= EXACT_RTOL**2 / 2}
    return later


def _stored_order(ids: Sequence[int | None]) -> list[int]:
    """Indices of ids, the first stored (lowest id) first; None (the query's side) last."""
    return sorted(range(len(ids)), key=lambda k: (ids[k] is None, ids[k] or 0))


def later_sums(G: np.ndarray, ids: Sequence[int | None]) -> set[int]:
    """Indices of the updates (G their Gram, ids their adapter ids) that are an exact non-negative sum of updates
    stored before them (a merge by cat or a plain sum; None last): a merge of the same parents is as exact with it
    among them, so it is left out and the parents named are the first stored."""
    order = _stored_order(ids)
    derived: set[int] = set()
    for pos, j in enumerate(order):
        before = [k for k in order[:pos] if k not in derived]
        if len(before) < 2 or G[j, j] <= 0:
            continue
        w = _nnls_gram(G[np.ix_(before, before)], G[before, j])
        if max(G[j, j] - 2 * w @ G[before, j] + w @ G[np.ix_(before, before)] @ w, 0.0) <= EXACT_RTOL**2 * G[j, j]:
            derived.add(j)
    return derived


def _aligned(mods: Mapping[str, LowRank], like: Mapping[str, LowRank]) -> dict[str, LowRank]:
    """The candidate's modules named as the query's, a missing one (rank 0) as an empty update."""
    empty = {n: LowRank(np.zeros((x.shape[0], 0)), np.zeros(0), np.zeros((x.shape[1], 0))) for n, x in like.items()}
    return {n: mods.get(n, empty[n]) for n in like}


def _nnls_gram(G: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin_{w ≥ 0} ‖Σ w_i x_i - y‖² from G = (⟨x_i, x_j⟩) and b = (⟨x_i, y⟩), in the columns' unit-norm scaling."""
    d = np.sqrt(np.maximum(np.diag(G), 1e-300))
    Gn, bn = G / np.outer(d, d), b / d
    ev, E = np.linalg.eigh(Gn)
    keep = ev > GRAM_RTOL * ev[-1]
    root = np.sqrt(ev[keep])
    z, _ = nnls(root[:, None] * E[:, keep].T, (E[:, keep].T @ bn) / root)
    return np.asarray(z / d)


def _support(weights: np.ndarray, norms: np.ndarray) -> list[int]:
    """Indices whose share of Σ w_i·‖dW_i‖ is at least MIN_SHARE, largest first."""
    contrib = weights * norms
    total = contrib.sum()
    if total <= 0:
        return []
    return [int(i) for i in np.argsort(-contrib) if contrib[i] >= MIN_SHARE * total]


def _sum_residual_sq(G: np.ndarray, b: np.ndarray, qq: float, idx: list[int]) -> float:
    """‖dW_q - Σ w_i dW_i‖² / ‖dW_q‖² of the non-negative fit over idx."""
    w = _nnls_gram(G[np.ix_(idx, idx)], b[idx]) if idx else np.zeros(0)
    return max(qq - 2 * w @ b[idx] + w @ G[np.ix_(idx, idx)] @ w, 0.0) / qq


def _unique_energy(G: np.ndarray, b: np.ndarray, qq: float, members: list[int]) -> float:
    """The least, over the members, rise of the dW-space fit's relative residual² when that member is left out."""
    base = _sum_residual_sq(G, b, qq, members)
    return min(_sum_residual_sq(G, b, qq, [j for j in members if j != i]) - base for i in members)


def _weighted_sum(stacks: Stacks, G: np.ndarray, b: np.ndarray, qq: float) -> _Hypothesis:
    """dW_q ≈ Σ w_i dW_i over the pool (members 1..size of each stack; G and b their Gram and products with dW_q)."""
    size = len(b)
    w = _nnls_gram(G, b)
    keep = _support(w, np.sqrt(np.diag(G)))
    if keep:
        w_keep = _nnls_gram(G[np.ix_(keep, keep)], b[keep])
        w = np.zeros(size)
        w[keep] = w_keep
    rho = math.sqrt(max(qq - 2 * w @ b + w @ G @ w, 0.0) / qq)
    members = tuple(keep)
    summed = all(g.ranks[0] == sum(g.ranks[i + 1] for i in members) for g in stacks.groups)
    return _Hypothesis("cat" if summed else "weighted_sum", members, w[list(members)], rho)


def _svd(stacks: Stacks, size: int) -> tuple[tuple[int, ...], np.ndarray] | None:
    """dW_q = top-r_q(Σ w_i dW_i): the members and weights from the projections U_qᵀ dW_i V_q (`_svd_hypothesis` checks
    them on the whole truncation)."""
    rows, target = [], []
    for g in stacks.groups:
        rows.append(g.projections(0, range(1, size + 1)))  # U_qᵀ dW_i V_q per pool member (modules × r_q × r_q × size)
        k = np.arange(g.ranks[0])
        diag = np.zeros((len(g.shapes), len(k), len(k)))
        diag[:, k, k] = g.S[0]
        target.append(diag)
    F = np.concatenate([r.reshape(-1, size) for r in rows])
    t = np.concatenate([x.ravel() for x in target])
    norms = np.linalg.norm(F, axis=0)
    if F.shape[0] <= size or not (norms > 0).all():
        return None
    w, _ = nnls(F / norms, t)
    w = w / norms
    full_norms = np.sqrt(np.diag(stacks.gram(list(range(1, size + 1)))))
    keep = _support(w, full_norms)
    if len(keep) < 2:
        return None
    w_keep, _ = nnls(F[:, keep] / norms[keep], t)
    return tuple(keep), w_keep / norms[keep]


def _svd_hypothesis(stacks: Stacks, keep: tuple[int, ...], w_keep: np.ndarray, qq: float) -> _Hypothesis:
    """The `svd` hypothesis of these members and weights, its residual that of the whole truncation."""
    members = [i + 1 for i in keep]
    mk, cross = np.sum([g.truncated_sums(0, members, w_keep) for g in stacks.groups], axis=0)
    residual = stacks.inner(0, 0) - 2 * float(cross) + float(mk)
    return _Hypothesis("svd", keep, w_keep, math.sqrt(max(residual, 0.0) / qq))


def _linear(stacks: Stacks, summed: _Hypothesis, max_parents: int, qq: float) -> _Hypothesis | None:
    """A_q = Σ √w_i A_i, B_q = Σ √w_i B_i: the joint-subspace fit over subsets of the likeliest candidates."""
    size = len(stacks.groups[0].ranks) - 1
    modules = stacks.modules()
    order = list(summed.members) + [i for i in range(size) if i not in summed.members]
    tried = order[:LINEAR_TRIED]
    best: _Hypothesis | None = None
    for n_parents in range(2, max_parents + 1):
        for subset in itertools.combinations(tried, n_parents):
            h = _linear_fit(modules, subset, qq)
            if h is not None and (best is None or h.rho < best.rho):
                best = h
        if best is not None and best.rho <= EXACT_RTOL:
            break  # the fewest parents that fit
    return best


def _linear_fit(stacks: Sequence[Stack], subset: tuple[int, ...], qq: float) -> _Hypothesis | None:
    """The joint-subspace fit over one subset, or None where it cannot hold: the subspaces could hold any update, or
    the residual of the modules fitted so far already passes EXACT_RTOL (only an exact `linear` is ever reported, so
    a subset that does not fit is given up at its first modules, not fitted on all of an adapter's 1,000)."""
    members = [i + 1 for i in subset]
    residual = diag_num = diag_den = 0.0
    limit = EXACT_RTOL**2 * qq
    blocks: list[tuple[Stack, np.ndarray]] = []
    for s in stacks:
        width = int(sum(s.offsets[i + 1] - s.offsets[i] for i in members))
        if width >= min(s.shape):
            return None  # the parents' subspaces could hold any update: no evidence
        C, r2 = s.block_fit(0, members)
        residual += r2
        if residual > limit:
            return None
        blocks.append((s, C))
    # w_i = Σ_m ⟨C_ii, diag S_i⟩ / Σ_m ‖S_i‖², then how far the diagonal blocks are from w_i·diag(S_i)
    diagonals = [[_diagonal_block(s, C, members, k) for s, C in blocks] for k in range(len(members))]
    w = np.array([sum(float(np.diag(b) @ S) for b, S in d) / max(sum(float(S @ S) for _, S in d), 1e-300) for d in diagonals])
    for k, d in enumerate(diagonals):
        for b, S in d:
            diag_num += float(((b - w[k] * np.diag(S)) ** 2).sum())
            diag_den += float(((w[k] * S) ** 2).sum())
    diagonal = math.sqrt(diag_num / diag_den) if diag_den > 0 else math.inf
    rho = math.sqrt(residual / qq)
    if (w <= 0).any():
        return None
    return _Hypothesis("linear", subset, w, max(rho, diagonal), {"subspace_residual": rho, "diagonal_misfit": diagonal})


def _diagonal_block(s: Stack, C: np.ndarray, members: list[int], k: int) -> tuple[np.ndarray, np.ndarray]:
    """(C_kk, S of member k): the block of C that maps member k's right factors to its left ones."""
    widths = [len(s.S[i]) for i in members]
    start = sum(widths[:k])
    return C[start : start + widths[k], start : start + widths[k]], s.S[members[k]]
