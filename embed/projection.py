"""The math of the zoo map: a 2-D PCA of one embedder's unit vectors (numpy only).

- **Fit**: rows are taken in id order, so a fit depends on the set of (id, vector) pairs and not on
  their order. Above `MAX_FIT` vectors it is fitted on a deterministic sample: the ids with the
  smallest `id_hash`, which spreads it over the id range and keeps most of it when the zoo grows.
  The axes are the top two eigenvectors of the sample's covariance (accumulated in float64).
- **Sign rule**: each axis points so that the sample's scores along it have positive skewness (a
  property of the data, not of the coordinates, so it survives rotations of the input and refits on a
  grown zoo). An axis whose skewness is below `MIN_SKEW` in size, where float noise could decide,
  points so that its largest-magnitude coordinate (the first of equals) is positive.
- **Project**: (v − mean) · basisᵀ in float64 from the float32 parameters that are stored, so a
  vector projected now or later with the same basis lands on the same point.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: the most vectors a projection is fitted on
MAX_FIT = 50_000
#: skewness below this (in size) leaves an axis's sign to its largest coordinate
MIN_SKEW = 1e-3
#: rows converted to float64 at a time
CHUNK = 4096


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
        for start in range(0, len(vectors), CHUNK):
            out[start : start + CHUNK] = (vectors[start : start + CHUNK].astype(np.float64) - mean) @ basis.T
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
    (see the module doc for the sample and the sign rule). No vectors: the first two coordinate axes."""
    vectors = np.asarray(vectors)
    if vectors.ndim != 2 or vectors.shape[1] < 2 or len(vectors) != len(ids):
        raise ValueError(f"expected one vector of dimension ≥ 2 per id, got {vectors.shape} for {len(ids)} ids")
    d = vectors.shape[1]
    if not len(vectors):
        return Projection(np.zeros(d, np.float32), np.eye(2, d, dtype=np.float32), (0.0, 0.0))
    sample = vectors[spread_sample(ids, max_fit)]
    mean = sample.mean(axis=0, dtype=np.float64)
    cov = np.zeros((d, d))
    for start in range(0, len(sample), CHUNK):
        x = sample[start : start + CHUNK].astype(np.float64) - mean
        cov += x.T @ x
    values, vecs = np.linalg.eigh(cov)  # ascending
    basis = vecs[:, ::-1][:, :2].T
    basis *= _signs(basis, Projection(mean, basis, (0.0, 0.0)).project(sample).astype(np.float64))[:, None]
    top, total = values[::-1][:2].clip(min=0), float(values.clip(min=0).sum())
    explained = (float(top[0]) / total, float(top[1]) / total) if total > 0 else (0.0, 0.0)
    return Projection(mean.astype(np.float32), basis.astype(np.float32), explained)


def _signs(basis: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """+1 or −1 per axis: positive skewness of the scores, else a positive largest coordinate."""
    m2 = np.mean(scores**2, axis=0)
    m3 = np.mean(scores**3, axis=0)
    skewed = np.abs(m3) > MIN_SKEW * np.maximum(m2, 1e-300) ** 1.5
    largest = basis[np.arange(len(basis)), np.argmax(np.abs(basis), axis=1)]
    return np.where(skewed, np.sign(m3), np.where(largest < 0, -1.0, 1.0))
