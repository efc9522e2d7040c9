"""Low-rank algebra of updates dW = U·diag(S)·Vᵀ in their factors (float64 numpy, no I/O).

No d_out × d_in matrix is ever formed: inner products, norms, projections and fits are read off the Gram
matrices of the stacked factors, ⟨U_x S_x V_xᵀ, U_y S_y V_yᵀ⟩ = Σ_ij S_x,i S_y,j (u_x,i·u_y,j)(v_x,i·v_y,j),
which cost O(r²·(out + in)) per pair. Everything is float64 from the stored float32 factors, and norms are
those of the matrices the factors represent (not Σ S², which assumes exactly orthonormal factors), so that
‖x - y‖² = ‖x‖² - 2⟨x, y⟩ + ‖y‖² keeps relative residuals down to ~1e-7 despite the cancellation.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from zoo.domain.canonical import CanonicalFactors
from zoo.domain.pair_blocks import Origin
from zoo.domain.products import cross

#: eigenvalues of a Gram matrix below this fraction of the largest are treated as zero (rank-deficient stacks)
GRAM_RTOL = 1e-10
#: what assembling a stack from a pair's kept blocks costs, in the multiply-adds of making the stack's Grams anew: a
#: stack whose Grams take fewer than this times its members² is made anew (small modules, few of them: 0.6 against 15
#: ms a stack on the lineage recipe), a larger one from the kept blocks
PAIR_OVERHEAD = 2e5


@dataclass(frozen=True)
class LowRank:
    """One module's update dW = U·diag(S)·Vᵀ in float64; canonical factors have S sorted descending."""

    U: np.ndarray  # (out, r)
    S: np.ndarray  # (r,)
    V: np.ndarray  # (in, r)
    #: (U_xᵀU_y, V_xᵀV_y, ⟨dW_x, dW_y⟩ or None) with other updates, by id, each with a weak reference that says it is
    #: still that update (`blocks`)
    kept_inners: dict[int, tuple[weakref.ref[LowRank], np.ndarray, np.ndarray, float | None]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    #: (ids of this update's module list, U_xᵀU_y, V_xᵀV_y) of its module list with other ones (modules × r × r), by the
    #: ids of the other list, whose first is weakly referenced (`group_blocks`)
    kept_groups: dict[tuple[int, ...], tuple[weakref.ref[LowRank], tuple[int, ...], np.ndarray, np.ndarray]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    #: the stored adapter's module this is, whose blocks with other stored modules are kept past both (zoo/domain/pair_blocks.py)
    origin: Origin | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, f: CanonicalFactors, origin: Origin | None = None) -> LowRank:
        """In float64, converted by numpy (exact, as torch's `.double()`, which took 10-20× as long on a stored blob's
        memory-mapped float32 factors: 1.1 s against 0.05 s an SDXL adapter)."""
        return cls(float64(f.U), float64(f.S), float64(f.V), origin)

    @cached_property
    def rank(self) -> int:
        return int(self.S.shape[0])

    @cached_property
    def shape(self) -> tuple[int, int]:
        return int(self.U.shape[0]), int(self.V.shape[0])

    def top(self, k: int) -> LowRank:
        """The best rank-k approximation (the first k canonical components)."""
        return LowRank(self.U[:, :k], self.S[:k], self.V[:, :k])

    @cached_property
    def sq_norm(self) -> float:
        """‖dW‖²_F of the matrix the factors represent (made once: an update is compared with many)."""
        UU, VV = self.self_blocks
        return float(((self.S[:, None] * UU * self.S[None, :]) * VV).sum())

    @cached_property
    def self_blocks(self) -> tuple[np.ndarray, np.ndarray]:
        """(UᵀU, VᵀV), made once (kept by its origin's store past this update)."""
        o = self.origin
        if o is not None and (kept := o.store.get(o, o)) is not None:
            return kept[0], kept[1]
        UU, VV = self.U.T @ self.U, self.V.T @ self.V
        if o is not None:
            o.store.put(o, o, UU, VV, None)
        return UU, VV


def inner(x: LowRank, y: LowRank) -> float:
    """⟨dW_x, dW_y⟩_F, made once per pair: the detectors test a pair both ways and for each relation (at Llama widths,
    2.5 of a scan's 6 s went to the same products three times)."""
    if x is y:
        return x.sq_norm
    known = _lookup(x, y)
    if known is not None and known[3] is not None:
        return known[3]
    UU, VV = blocks(x, y)
    value = float(((x.S[:, None] * UU * y.S[None, :]) * VV).sum())
    _keep(x, y, UU, VV, value)
    return value


def blocks(x: LowRank, y: LowRank) -> tuple[np.ndarray, np.ndarray]:
    """(U_xᵀU_y, V_xᵀV_y), made once per pair and kept while both updates live: every quantity between two updates is
    read off them (their inner product, the merge test's stacked Grams, the continuation test's shared rows), and the
    relation step compares each with its neighbours' neighbours too, which are mostly its own."""
    if x is y:
        return x.self_blocks
    known = _lookup(x, y)
    if known is not None:
        return known[1], known[2]
    UU, VV = _products(x, y)
    _keep(x, y, UU, VV, None)
    return UU, VV


def _products(x: LowRank, y: LowRank) -> tuple[np.ndarray, np.ndarray]:
    """(U_xᵀU_y, V_xᵀV_y), two products of this pair alone. Not of x with several updates' factors concatenated: copying
    those cost as much as the product (a Llama-3-8B MLP module against 8 others: 2.4 of 4.9 ms, against 2.8 ms pair by
    pair; an SDXL attention module's 0.09 against 0.03 ms)."""
    return cross(x.U, y.U), cross(x.V, y.V)


def fill_blocks(x: Mapping[str, LowRank], others: Sequence[Mapping[str, LowRank]]) -> None:
    """Make the blocks (`blocks`) of each module of x with the same module of each of `others` not made yet."""
    for name, m in x.items():
        for o in others:
            if (y := o.get(name)) is not None and y is not m and y.shape == m.shape:
                blocks(m, y)


def _keep(x: LowRank, y: LowRank, UU: np.ndarray, VV: np.ndarray, value: float | None, stored: bool = True) -> None:
    """Keep a pair's blocks (and inner product, once known) on both updates, each entry with a weak reference that says
    it is still of that update (an id is reused once its update is gone) and drops the entry when that update goes; and
    in their origins' store where both name one (unless `stored`: they come from it)."""
    x.kept_inners[id(y)] = (weakref.ref(y, _dropper(x, "kept_inners", id(y))), UU, VV, value)
    y.kept_inners[id(x)] = (weakref.ref(x, _dropper(y, "kept_inners", id(x))), UU.T, VV.T, value)
    if stored and (pair := _origins(x, y)) is not None:
        pair[0].store.put(*pair, UU, VV, value)


def _origins(x: LowRank, y: LowRank) -> tuple[Origin, Origin] | None:
    """The origins of two modules of one store and name, of two adapters (a module with itself has its self blocks)."""
    a, b = x.origin, y.origin
    if a is None or b is None or a.store is not b.store or a.module != b.module or a.adapter_id == b.adapter_id:
        return None
    return a, b


def _lookup(x: LowRank, y: LowRank) -> tuple[weakref.ref[LowRank], np.ndarray, np.ndarray, float | None] | None:
    """The pair's kept entry on x: its own, else from their origins' store (then kept on both, as made)."""
    known = x.kept_inners.get(id(y))
    if known is not None and known[0]() is y:
        return known
    if (pair := _origins(x, y)) is None or (kept := pair[0].store.get(*pair)) is None:
        return None
    _keep(x, y, *kept, stored=False)
    return x.kept_inners[id(y)]


def _dropper(holder: LowRank, table: str, key: Hashable) -> Callable[[weakref.ref[LowRank]], None]:
    """A callback that removes entry `key` of `holder`'s kept blocks (its attribute `table`: `kept_inners` or `kept_groups`)
    once the update it names is gone (holding `holder` weakly)."""
    held = weakref.ref(holder)

    def drop(ref: weakref.ref[LowRank]) -> None:
        h = held()
        entries = getattr(h, table) if h is not None else {}
        if (entry := entries.get(key)) is not None and entry[0] is ref:
            del entries[key]

    return drop


def float64(t: torch.Tensor) -> np.ndarray:
    """A float tensor as a float64 array (exact for float32, float16 and bfloat16 alike)."""
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy().astype(np.float64)


def sq_norm(x: LowRank) -> float:
    """‖dW_x‖²_F of the matrix the factors represent."""
    return x.sq_norm


def sample_entries(x: LowRank, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """The entries dW[rows][:, cols] (a block, formed from the sampled factor rows only)."""
    return (x.U[rows] * x.S) @ x.V[cols].T


class Stack:
    """Several updates of one module stacked: the Gram matrices of their left and right factors.

    Member i owns columns offsets[i]:offsets[i + 1] of the stacked U and V; every quantity among
    members is read off the two Grams, the long factors are touched once (O(out·R² + in·R²), R the
    summed ranks).
    """

    def __init__(self, members: Sequence[LowRank]) -> None:
        offsets = np.concatenate([[0], np.cumsum([m.rank for m in members])]).astype(int)
        UU, VV = _stacked_grams(members, offsets)
        S, owner = [m.S for m in members], _owner([m.rank for m in members])
        # ⟨dW_i, dW_j⟩ for all members at once: the (i, j) block sums of (S UᵀU S) ∘ VᵀV
        gram = owner.T @ ((np.concatenate(S)[:, None] * UU * np.concatenate(S)[None, :]) * VV) @ owner
        self._set(S, offsets, UU, VV, gram, members[0].shape)

    def _set(
        self, S: list[np.ndarray], offsets: np.ndarray, UU: np.ndarray, VV: np.ndarray, gram: np.ndarray, shape: tuple[int, int]
    ) -> None:
        self.S, self.offsets, self.UU, self.VV, self._gram, self.shape = S, offsets, UU, VV, gram, shape

    @classmethod
    def of(
        cls, S: list[np.ndarray], offsets: np.ndarray, UU: np.ndarray, VV: np.ndarray, gram: np.ndarray, shape: tuple[int, int]
    ) -> Stack:
        """A stack from its parts, made already (one module of `Stacks`)."""
        stack = cls.__new__(cls)
        stack._set(S, offsets, UU, VV, gram, shape)
        return stack

    def cols(self, idx: Sequence[int]) -> np.ndarray:
        return np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in idx]).astype(int)

    def inner(self, i: int, j: int) -> float:
        return float(self._gram[i, j])

    def gram(self, idx: Sequence[int]) -> np.ndarray:
        """⟨dW_i, dW_j⟩ for i, j in idx."""
        return self._gram[np.ix_(idx, idx)]

    def projections(self, query: int, idx: Sequence[int]) -> np.ndarray:
        """U_qᵀ·dW_i·V_q for each member i of idx, in one product: (r_q, r_q, len(idx))."""
        q, cols = self.cols([query]), self.cols(idx)
        S = np.concatenate([self.S[i] for i in idx])
        owner = _owner([len(self.S[i]) for i in idx])
        return np.einsum("ac,cb,ci->abi", self.UU[np.ix_(q, cols)] * S, self.VV[np.ix_(cols, q)], owner)

    def block_fit(self, query: int, idx: Sequence[int]) -> tuple[np.ndarray, float]:
        """The least-squares C with dW_query ≈ 𝒰·C·𝒱ᵀ over the stacked factors of idx (left and right
        subspaces spanned jointly), and the squared residual."""
        a, q = self.cols(idx), self.cols([query])
        target = self.UU[np.ix_(a, q)] * self.S[query][None, :] @ self.VV[np.ix_(q, a)]  # 𝒰ᵀ dW_q 𝒱
        C = _pinv(self.UU[np.ix_(a, a)]) @ target @ _pinv(self.VV[np.ix_(a, a)])
        residual = self.inner(query, query) - float((C * target).sum())  # the fit is a projection
        return C, max(residual, 0.0)

    def truncated_sum(self, query: int, idx: Sequence[int], weights: np.ndarray, k: int) -> tuple[float, float]:
        """(‖M_k‖², ⟨M_k, dW_query⟩) for M_k the best rank-k approximation of M = Σ w_i dW_i over idx."""
        a, q = self.cols(idx), self.cols([query])
        d = np.concatenate([w * self.S[i] for w, i in zip(weights, idx, strict=True)])
        root_u, inv_u = _gram_roots(self.UU[np.ix_(a, a)])  # 𝒰 = Q_U·root_u with Q_U orthonormal
        root_v, inv_v = _gram_roots(self.VV[np.ix_(a, a)])
        X, sigma, Yt = np.linalg.svd((root_u * d) @ root_v.T)  # M = Q_U (X Σ Yᵀ) Q_Vᵀ
        X, sigma, Y = X[:, :k], sigma[:k], Yt[:k].T
        left = X.T @ inv_u @ self.UU[np.ix_(a, q)]  # X_kᵀ Q_Uᵀ U_q
        right = Y.T @ inv_v @ self.VV[np.ix_(a, q)]
        return float((sigma**2).sum()), float((sigma[:, None] * left * self.S[query][None, :] * right).sum())


def _stacked_grams(members: Sequence[LowRank], offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The Grams of the stacked U and V from the pairs' blocks (`blocks`, made where not made yet)."""
    R = int(offsets[-1])
    UU, VV = np.empty((R, R)), np.empty((R, R))
    for i, x in enumerate(members):
        for j, y in enumerate(members[i:], start=i):
            bu, bv = blocks(x, y)
            rows, cols = slice(offsets[i], offsets[i + 1]), slice(offsets[j], offsets[j + 1])
            UU[rows, cols], VV[rows, cols] = bu, bv
            UU[cols, rows], VV[cols, rows] = bu.T, bv.T
    return UU, VV


class Stacks:
    """Several updates stacked module by module (members[0] first, as the query), batched: the modules where every
    member has one rank form a group, whose Grams are (modules × R × R) arrays made of the pairs' blocks across those
    modules (`group_blocks`), so that the work per stack is per pair of members, not per module (an SDXL adapter has
    418). `modules()` gives each module's `Stack`, in the order of `names`' groups."""

    def __init__(self, members: Sequence[Mapping[str, LowRank]], names: Sequence[str], from_pairs: bool | None = None) -> None:
        """`from_pairs`: assemble the Grams from the pairs' kept blocks (True) or make them at once (False); by default as
        PAIR_OVERHEAD says."""
        by_ranks: dict[tuple[int, ...], list[str]] = {}
        for n in names:
            by_ranks.setdefault(tuple(m[n].rank for m in members), []).append(n)
        self.groups = [_Group([[m[n] for n in group] for m in members], ranks, from_pairs) for ranks, group in by_ranks.items()]
        self.names = [n for group in by_ranks.values() for n in group]

    def inner(self, i: int, j: int) -> float:
        """⟨dW_i, dW_j⟩ summed over the modules."""
        return float(sum(g.gram[:, i, j].sum() for g in self.groups))

    def gram(self, idx: Sequence[int]) -> np.ndarray:
        """⟨dW_i, dW_j⟩ summed over the modules, for i, j in idx."""
        return np.sum([g.gram[:, idx][:, :, idx].sum(axis=0) for g in self.groups], axis=0)

    def modules(self) -> list[Stack]:
        """Each module's stack (views of the groups' arrays)."""
        return [g.module(k) for g in self.groups for k in range(len(g.shapes))]


class _Group:
    """Modules where each member has one rank: Grams (modules × R × R), S per member (modules × rank)."""

    def __init__(self, mods: list[list[LowRank]], ranks: tuple[int, ...], from_pairs: bool | None) -> None:
        self.ranks = ranks
        self.offsets = np.concatenate([[0], np.cumsum(ranks)]).astype(int)
        self.shapes = [x.shape for x in mods[0]]
        n, R = len(mods[0]), int(self.offsets[-1])
        self.S = [np.stack([x.S for x in m]) if m else np.zeros((0, r)) for m, r in zip(mods, ranks, strict=True)]
        if from_pairs is None:  # small modules: at once
            from_pairs = sum(R * R * (o + i) for o, i in self.shapes) >= PAIR_OVERHEAD * len(mods) ** 2
        if not from_pairs:
            self.UU = np.stack([_gram(np.concatenate([m[k].U for m in mods], axis=1)) for k in range(n)])
            self.VV = np.stack([_gram(np.concatenate([m[k].V for m in mods], axis=1)) for k in range(n)])
        else:
            self.UU, self.VV = self._from_pairs(mods)
        S = np.concatenate(self.S, axis=1) if self.S else np.zeros((n, 0))
        products = (S[:, :, None] * self.UU * S[:, None, :]) * self.VV
        if len(set(ranks)) == 1 and ranks[0] > 0:  # the block sums by a reshape (a product with `owner` took 0.14 s an SDXL query)
            M, r = len(ranks), ranks[0]
            self.gram = products.reshape(n, M, r, M, r).sum(axis=(2, 4))
        else:
            owner = _owner(list(ranks))
            self.gram = owner.T @ products @ owner

    def _from_pairs(self, mods: list[list[LowRank]]) -> tuple[np.ndarray, np.ndarray]:
        n, R = len(mods[0]), int(self.offsets[-1])
        UU, VV = np.empty((n, R, R)), np.empty((n, R, R))
        for i, xs in enumerate(mods):
            for j in range(i, len(mods)):
                bu, bv = group_blocks(xs, mods[j])
                rows, cols = slice(self.offsets[i], self.offsets[i + 1]), slice(self.offsets[j], self.offsets[j + 1])
                UU[:, rows, cols], VV[:, rows, cols] = bu, bv
                UU[:, cols, rows], VV[:, cols, rows] = bu.transpose(0, 2, 1), bv.transpose(0, 2, 1)
        return UU, VV

    def cols(self, idx: Iterable[int]) -> np.ndarray:
        return np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in idx]).astype(int)

    def projections(self, query: int, idx: Sequence[int]) -> np.ndarray:
        """`Stack.projections` of each module: (modules × r_q × r_q × len(idx))."""
        q, cols = self.cols([query]), self.cols(idx)
        S = np.concatenate([self.S[i] for i in idx], axis=1)
        owner = _owner([self.ranks[i] for i in idx])
        if len(set(self.ranks[i] for i in idx)) == 1:  # by member without `owner` (an einsum of three took 0.2 s an SDXL query)
            r, m = self.ranks[idx[0]], len(idx)
            left = (self.UU[:, q][:, :, cols] * S[:, None, :]).reshape(len(S), len(q), m, r)
            return np.einsum("namc,nmcb->nabm", left, self.VV[:, cols][:, :, q].reshape(len(S), m, r, len(q)))
        return np.einsum("nac,ncb,ci->nabi", self.UU[:, q][:, :, cols] * S[:, None, :], self.VV[:, cols][:, :, q], owner)

    def truncated_sums(self, query: int, idx: Sequence[int], weights: np.ndarray) -> np.ndarray:
        """(Σ ‖M_k‖², Σ ⟨M_k, dW_query⟩) over the modules, `Stack.truncated_sum` with k the query's rank, in one eigh
        and one SVD call for all the group's modules (not three a module)."""
        k = self.ranks[query]
        if k == 0 or not self.shapes:
            return np.zeros(2)
        a, q = self.cols(idx), self.cols([query])
        d = np.concatenate([w * self.S[i] for w, i in zip(weights, idx, strict=True)], axis=1)
        root_u, inv_u = _gram_roots_batched(self.UU[:, a][:, :, a])  # 𝒰 = Q_U·root_u with Q_U orthonormal
        root_v, inv_v = _gram_roots_batched(self.VV[:, a][:, :, a])
        X, sigma, Yt = np.linalg.svd((root_u * d[:, None, :]) @ root_v.transpose(0, 2, 1))  # M = Q_U (X Σ Yᵀ) Q_Vᵀ
        X, sigma, Y = X[:, :, :k], sigma[:, :k], Yt[:, :k].transpose(0, 2, 1)
        left = X.transpose(0, 2, 1) @ inv_u @ self.UU[:, a][:, :, q]  # X_kᵀ Q_Uᵀ U_q
        right = Y.transpose(0, 2, 1) @ inv_v @ self.VV[:, a][:, :, q]
        return np.array([float((sigma**2).sum()), float((sigma[:, :, None] * left * self.S[query][:, None, :] * right).sum())])

    def module(self, k: int) -> Stack:
        S = [s[k] for s in self.S]
        return Stack.of(S, self.offsets, self.UU[k], self.VV[k], self.gram[k], self.shapes[k])


def _gram(F: np.ndarray) -> np.ndarray:
    return F.T @ F


def group_blocks(xs: Sequence[LowRank], ys: Sequence[LowRank]) -> tuple[np.ndarray, np.ndarray]:
    """(U_xᵀU_y, V_xᵀV_y) of each pair of modules of two updates, stacked (modules × r_x × r_y: the modules of one
    rank each), made once per pair of module lists and kept on their first modules while those live."""
    if not xs:
        return np.zeros((0, 0, 0)), np.zeros((0, 0, 0))
    if all(x is y for x, y in zip(xs, ys, strict=True)):
        return np.stack([x.self_blocks[0] for x in xs]), np.stack([x.self_blocks[1] for x in xs])
    ids = tuple(map(id, ys))
    known = xs[0].kept_groups.get(ids)
    if known is not None and known[0]() is ys[0] and known[1] == tuple(map(id, xs)):
        return known[2], known[3]
    made = [blocks(x, y) for x, y in zip(xs, ys, strict=True)]
    UU, VV = np.stack([b[0] for b in made]), np.stack([b[1] for b in made])
    _keep_group(xs, ys, UU, VV)
    return UU, VV


def _keep_group(xs: Sequence[LowRank], ys: Sequence[LowRank], UU: np.ndarray, VV: np.ndarray) -> None:
    x_ids, y_ids = tuple(map(id, xs)), tuple(map(id, ys))
    xs[0].kept_groups[y_ids] = (weakref.ref(ys[0], _dropper(xs[0], "kept_groups", y_ids)), x_ids, UU, VV)
    ys[0].kept_groups[x_ids] = (
        weakref.ref(xs[0], _dropper(ys[0], "kept_groups", x_ids)),
        y_ids,
        UU.transpose(0, 2, 1),
        VV.transpose(0, 2, 1),
    )


def _gram_roots_batched(G: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_gram_roots` of a batch of Grams of one size, the directions dropped there left as zero rows (which add only zero
    singular values and zero products)."""
    ev, E = np.linalg.eigh(G)
    keep = ev > GRAM_RTOL * np.maximum(ev[:, -1:], 0.0)
    root = np.where(keep, np.sqrt(np.where(keep, ev, 1.0)), 0.0)
    inv = np.where(keep, 1.0 / np.sqrt(np.where(keep, ev, 1.0)), 0.0)
    Et = E.transpose(0, 2, 1)
    return root[:, :, None] * Et, inv[:, :, None] * Et


def _owner(ranks: Sequence[int]) -> np.ndarray:
    """(Σ ranks × members): 1 where a stacked column belongs to a member, so that block sums are one product."""
    owner = np.zeros((sum(ranks), len(ranks)))
    owner[np.arange(sum(ranks)), np.repeat(np.arange(len(ranks)), ranks)] = 1.0
    return owner


def _pinv(G: np.ndarray) -> np.ndarray:
    return np.linalg.pinv(G, rcond=GRAM_RTOL, hermitian=True)


def _gram_roots(G: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(R, Q⁻ᵀ-map) for a Gram G = FᵀF: R = Λ^½Eᵀ with F = Q·R, Q orthonormal over G's range, and Λ^-½Eᵀ, so that
    Qᵀ·Z = (Λ^-½Eᵀ)·(FᵀZ) for any Z."""
    ev, E = np.linalg.eigh(G)
    keep = ev > GRAM_RTOL * max(float(ev[-1]), 0.0)
    ev, E = ev[keep], E[:, keep]
    return np.sqrt(ev)[:, None] * E.T, E.T / np.sqrt(ev)[:, None]
