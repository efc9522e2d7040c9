"""Exact cosine search by numpy, the reference an index is measured against: the exact top k, the ties of its k-th, and
recall@k."""

from __future__ import annotations

import numpy as np

#: exact scores within this of the k-th are ties when nprobe is tuned: at least what the float16 store rounds a cosine by,
#: so which of them is "the" k-th is decided by rounding (a space of near-copies has hundreds within it); an 8-bit
#: store's ties are wider (`AdapterIndex.tie`)
TIE = 1e-4


def normalize(vectors: np.ndarray) -> np.ndarray:
    v = np.ascontiguousarray(vectors, dtype=np.float32)
    if v.ndim == 1:
        v = v[None, :]
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    return v / np.maximum(norms, 1e-12)


def brute_force(ids: np.ndarray, vectors: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The numpy reference: exact cosine top-k."""
    sims = normalize(queries) @ normalize(vectors).T
    order = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(sims, order, axis=1), np.asarray(ids, dtype=np.int64)[order]


class TiedTop:
    """The exact top k of some queries with their ties: the neighbours scoring more than `tie` above the k-th must be
    found themselves; the rest of the k may be any adapters whose exact score is within `tie` of the k-th's."""

    def __init__(self, scores: np.ndarray, ids: np.ndarray, k: int, tie: float = TIE) -> None:
        kth = scores[:, k - 1 : k]
        self.k = k
        self.above = [set(row[s > t + tie].tolist()) for row, s, t in zip(ids, scores, kth, strict=True)]
        self.tied = [set(row[np.abs(s - t) <= tie].tolist()) for row, s, t in zip(ids, scores, kth, strict=True)]

    def recall(self, found: np.ndarray) -> float:
        """Mean share of the k that `found` (ids per query, -1 pads) holds, a tie of the k-th standing for any other."""
        shares = []
        for row, above, tied in zip(found, self.above, self.tied, strict=True):
            got = set(row.tolist())
            shares.append((len(above & got) + min(self.k - len(above), len(tied & got))) / self.k)
        return float(np.mean(shares))


def recall_at_k(approx_ids: np.ndarray, exact_ids: np.ndarray) -> float:
    hits = [len(set(a.tolist()) & set(e.tolist())) / max(1, len(e)) for a, e in zip(approx_ids, exact_ids, strict=True)]
    return float(np.mean(hits)) if hits else 1.0
