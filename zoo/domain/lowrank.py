"""Low-rank algebra of updates dW = U·diag(S)·Vᵀ in their factors (float64 numpy, no I/O).

No d_out × d_in matrix is ever formed: inner products, norms, projections and fits are read off the Gram
matrices of the stacked factors, ⟨U_x S_x V_xᵀ, U_y S_y V_yᵀ⟩ = Σ_ij S_x,i S_y,j (u_x,i·u_y,j)(v_x,i·v_y,j),
which cost O(r²·(out + in)) per pair. Everything is float64 from the stored float32 factors, and norms are
those of the matrices the factors represent (not Σ S², which assumes exactly orthonormal factors), so that
‖x - y‖² = ‖x‖² - 2⟨x, y⟩ + ‖y‖² keeps relative residuals down to ~1e-7 despite the cancellation.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from zoo.domain.canonical import CanonicalFactors

#: eigenvalues of a Gram matrix below this fraction of the largest are treated as zero (rank-deficient stacks)
GRAM_RTOL = 1e-10


@dataclass(frozen=True)
class LowRank:
    """One module's update dW = U·diag(S)·Vᵀ in float64; canonical factors have S sorted descending."""

    U: np.ndarray  # (out, r)
    S: np.ndarray  # (r,)
    V: np.ndarray  # (in, r)
    #: inner products with other updates, by id, each with a weak reference that says it is still that update
    _inners: dict[int, tuple[weakref.ref[LowRank], float]] = field(default_factory=dict, init=False, compare=False, repr=False)

    @classmethod
    def of(cls, f: CanonicalFactors) -> LowRank:
        return cls(f.U.double().numpy(), f.S.double().numpy(), f.V.double().numpy())

    @property
    def rank(self) -> int:
        return int(self.S.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.U.shape[0]), int(self.V.shape[0])

    def top(self, k: int) -> LowRank:
        """The best rank-k approximation (the first k canonical components)."""
        return LowRank(self.U[:, :k], self.S[:k], self.V[:, :k])

    @cached_property
    def sq_norm(self) -> float:
        """‖dW‖²_F of the matrix the factors represent (made once: an update is compared with many)."""
        return _inner(self, self)


def inner(x: LowRank, y: LowRank) -> float:
    """⟨dW_x, dW_y⟩_F, made once per pair: the detectors test a pair both ways and for each relation (at Llama widths,
    2.5 of a scan's 6 s went to the same products three times)."""
    if x is y:
        return x.sq_norm
    known = x._inners.get(id(y))
    if known is not None and known[0]() is y:
        return known[1]
    value = _inner(x, y)
    x._inners[id(y)], y._inners[id(x)] = (weakref.ref(y), value), (weakref.ref(x), value)
    return value


def _inner(x: LowRank, y: LowRank) -> float:
    return float(((x.S[:, None] * (x.U.T @ y.U) * y.S[None, :]) * (x.V.T @ y.V)).sum())


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
        self.S = [m.S for m in members]
        self.offsets = np.concatenate([[0], np.cumsum([m.rank for m in members])]).astype(int)
        U = np.concatenate([m.U for m in members], axis=1)
        V = np.concatenate([m.V for m in members], axis=1)
        self.UU = U.T @ U
        self.VV = V.T @ V
        self.shape = members[0].shape
        # ⟨dW_i, dW_j⟩ for all members at once: the (i, j) block sums of (S UᵀU S) ∘ VᵀV
        S = np.concatenate(self.S)
        owner = _owner([len(s) for s in self.S])
        self._gram = owner.T @ ((S[:, None] * self.UU * S[None, :]) * self.VV) @ owner

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
