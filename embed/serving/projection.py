"""The math of the zoo map: a 2-D PCA of one embedder's unit vectors (numpy only).

- **Fit**: rows are taken in id order, so a fit depends on the set of (id, vector) pairs and not on
  their order. Above `MAX_FIT` vectors it is fitted on a deterministic sample: the ids with the
  smallest `id_hash`, which spreads it over the id range and keeps most of it when the zoo grows.
  The axes are the top two eigenvectors of the sample's covariance C = XᵀX (X the centred sample),
  found without forming C (d × d would be 30 GiB at SDXL's d = 63,296): a block Lanczos iteration
  from a fixed random start, thick-restarted, whose every pass reads the sample once in float64
  chunks of at most `CHUNK_BYTES` (Xᵀ(X V) per chunk), until the two Ritz pairs' residuals are below
  `TOL` × the largest, or nothing but float noise is left outside the basis (at most `MAX_PASSES`
  passes; a flat spectrum, whose top axes are nearly arbitrary, is the slow case). Where d ≤ `BLOCK`
  the start is the identity and the first pass is exact. Blocks are orthonormalized through their
  small Gram matrices; working memory is O(d · `MAX_BLOCKS` · `BLOCK`) beside the sample, and the same
  sample gives the same bits. The share of variance is against the trace (the sum of squared centred
  entries).
- **Sign rule**: each axis points so that the sample's scores along it (its points as projected with
  the stored float32 parameters) have positive skewness (a property of the data, not of the
  coordinates, so it survives rotations of the input and refits on a grown zoo). An axis whose
  skewness is below `MIN_SKEW` in size, where float noise could decide, points so that its
  largest-magnitude coordinate (the first of equals) is positive.
- **Project**: (v − mean) · basisᵀ in float64 from the float32 parameters that are stored, so a
  vector projected now or later with the same basis lands on the same point.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

#: the most vectors a projection is fitted on
MAX_FIT = 50_000
#: skewness below this (in size) leaves an axis's sign to its largest coordinate
MIN_SKEW = 1e-3
#: bytes of float64 rows converted at a time (fit and project)
CHUNK_BYTES = 32 << 20
#: columns the fit's iteration carries: more converge in fewer passes over the sample
BLOCK = 32
#: the Lanczos basis is restarted from the best `BLOCK` directions when it would outgrow this many blocks
MAX_BLOCKS = 4
#: stop when both axes' residuals ‖Cu − θu‖ are below this × the largest Ritz value θ₁
TOL = 1e-8
#: passes over the sample at most (flat spectra converge slowly; their top axes are nearly arbitrary anyway)
MAX_PASSES = 64
#: directions whose part outside the basis is below this × θ₁ are float noise and dropped
RANK_TOL = 1e-10
#: the start block's seed
SEED = 0


@dataclass(frozen=True)
class Projection:
    """A fitted 2-D basis: `mean` (d,) and `basis` (2, d) with orthonormal rows, both float32;
    `explained` is the share of the fitted vectors' variance along each axis."""

    mean: np.ndarray
    basis: np.ndarray
    explained: tuple[float, float]

    def project(self, vectors: np.ndarray) -> np.ndarray:
        """The (n, 2) float32 points of `vectors` (n, d)."""
        vectors = np.asarray(vectors)
        mean, basis = self.mean.astype(np.float64), self.basis.astype(np.float64)
        out = np.empty((len(vectors), 2), np.float32)
        for start, x in centred_chunks(vectors, mean):
            out[start : start + len(x)] = x @ basis.T
        return out


def id_hash(ids: np.ndarray) -> np.ndarray:
    """A fixed bijective mix of int64 ids into uint64 (the splitmix64 finalizer): a stable pseudo-random order."""
    x = np.asarray(ids, dtype=np.int64).astype(np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def spread_sample(ids: np.ndarray, k: int, keep: np.ndarray | None = None) -> np.ndarray:
    """Positions of at most k of the (distinct) `ids`, in id order: those in `keep` first, then those
    with the smallest `id_hash`. The same ids give the same choice in any order."""
    ids = np.asarray(ids, dtype=np.int64)
    kept = np.isin(ids, keep) if keep is not None else np.zeros(len(ids), bool)
    chosen = np.lexsort((id_hash(ids), ~kept))[:k] if len(ids) > k else np.arange(len(ids))
    return chosen[np.argsort(ids[chosen], kind="stable")]


def fit(ids: np.ndarray, vectors: np.ndarray, max_fit: int = MAX_FIT) -> Projection:
    """The PCA projection of (ids, vectors) onto two axes, on a sample of at most `max_fit` vectors
    (see the module doc for the sample, the iteration and the sign rule). No vectors, or no variance:
    the first two coordinate axes."""
    vectors = np.asarray(vectors)
    if vectors.ndim != 2 or vectors.shape[1] < 2 or len(vectors) != len(ids):
        raise ValueError(f"expected one vector of dimension ≥ 2 per id, got {vectors.shape} for {len(ids)} ids")
    d = vectors.shape[1]
    rows = spread_sample(ids, max_fit)
    sample = vectors if np.array_equal(rows, np.arange(len(vectors))) else vectors[rows]  # no copy when in id order
    mean = sample.mean(axis=0, dtype=np.float64) if len(sample) else np.zeros(d)
    values, basis, total = top_axes(sample, mean) if len(sample) else (np.zeros(2), np.eye(2, d), 0.0)
    if not total > 0:
        return Projection(mean.astype(np.float32), np.eye(2, d, dtype=np.float32), (0.0, 0.0))
    mean32, basis32 = mean.astype(np.float32), basis.astype(np.float32)
    scores = Projection(mean32, basis32, (0.0, 0.0)).project(sample).astype(np.float64)  # the points as served
    basis32 *= _signs(basis32, scores)[:, None].astype(np.float32)
    top = values.clip(min=0)
    return Projection(mean32, basis32, (float(top[0]) / total, float(top[1]) / total))


def top_axes(sample: np.ndarray, mean: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """(the two largest eigenvalues, their unit eigenvectors as rows (2, d), the trace) of C = (sample − mean)ᵀ(sample − mean),
    by a thick-restarted block Lanczos iteration that never forms C (see the module doc)."""
    d = sample.shape[1]
    k = min(BLOCK, d)
    v = np.eye(d, k) if k == d else _outside(np.zeros((d, 0)), np.random.default_rng(SEED).standard_normal((d, k)), 0.0)
    w, trace = times_covariance(sample, mean, v, trace=True)
    for passes in range(1, MAX_PASSES + 1):
        h = v.T @ w
        theta, y = np.linalg.eigh((h + h.T) / 2)  # Rayleigh–Ritz on span(v), ascending
        theta, y = theta[::-1], y[:, ::-1]
        top = y[:, :2]
        residual = np.linalg.norm(w @ top - (v @ top) * theta[:2], axis=0).max()
        scale = max(float(theta[0]), np.finfo(float).tiny)
        if residual <= TOL * scale or passes == MAX_PASSES:
            break
        if v.shape[1] + k > MAX_BLOCKS * k:  # thick restart: keep the best k Ritz pairs (C v known for them)
            v, w, theta = v @ y[:, :k], w @ y[:, :k], theta[:k]
            new = _outside(v, w - v * theta, RANK_TOL * scale)
        else:
            new = _outside(v, w[:, -k:], RANK_TOL * scale)
        if not new.shape[1]:  # span(v) is invariant under C: the Ritz pairs are exact
            break
        v, w = np.hstack([v, new]), np.hstack([w, times_covariance(sample, mean, new)[0]])
    return theta[:2], (v @ top).T, trace


def _outside(basis: np.ndarray, w: np.ndarray, floor: float) -> np.ndarray:
    """Orthonormal columns spanning the part of w outside span(basis), directions of norm ≤ floor dropped."""
    for _ in range(2):
        w = w - basis @ (basis.T @ w)
    w = _orthonormal(w, floor)
    w = w - basis @ (basis.T @ w)  # normalizing a small remainder magnifies its overlap with the basis: again
    return _orthonormal(w, 1e-3 * np.linalg.norm(w, axis=0).max(initial=0.0))


def _orthonormal(w: np.ndarray, floor: float) -> np.ndarray:
    """Orthonormal columns spanning w's directions of singular value above floor, from the eigenvectors of the
    small Gram matrix wᵀw (tall QR or SVD in LAPACK can be a hundred times slower than this GEMM under load)."""
    values, z = np.linalg.eigh(w.T @ w)
    keep = values > floor**2
    return (w @ z[:, keep]) / np.sqrt(values[keep])


def times_covariance(sample: np.ndarray, mean: np.ndarray, v: np.ndarray, trace: bool = False) -> tuple[np.ndarray, float]:
    """(C v, and when asked the trace of C) = Σ over chunks of (xᵀ(x v), Σ x²), x a float64 chunk of the centred sample."""
    out, total = np.zeros((sample.shape[1], v.shape[1])), 0.0
    for _, x in centred_chunks(sample, mean):
        out += x.T @ (x @ v)
        total += float(np.einsum("ij,ij->", x, x)) if trace else 0.0
    return out, total


def centred_chunks(vectors: np.ndarray, mean: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(start, float64 rows − mean) chunk by chunk, at most `CHUNK_BYTES` (and at least one row) each."""
    rows = max(1, CHUNK_BYTES // (8 * max(vectors.shape[1], 1)))
    for start in range(0, len(vectors), rows):
        x = vectors[start : start + rows].astype(np.float64)
        x -= mean
        yield start, x


def _signs(basis: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """+1 or −1 per axis: positive skewness of the scores, else a positive largest coordinate."""
    m2 = np.mean(scores**2, axis=0)
    m3 = np.mean(scores**3, axis=0)
    skewed = np.abs(m3) > MIN_SKEW * np.maximum(m2, 1e-300) ** 1.5
    largest = basis[np.arange(len(basis)), np.argmax(np.abs(basis), axis=1)]
    return np.where(skewed, np.sign(m3), np.where(largest < 0, -1.0, 1.0))
