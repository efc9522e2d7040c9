"""Predictions from a query's labelled neighbours: the similarity-weighted kNN vote and mean the engine serves."""

from __future__ import annotations

import numpy as np

from embed.selection.metrics import KNN_K, knn_regress, knn_vote_shares, top_k


def knn_shares(
    near: tuple[np.ndarray, np.ndarray],
    classes: np.ndarray,
    n_classes: int,
    fallback: np.ndarray,
    k: int = KNN_K,
    temperature: float | None = None,
) -> np.ndarray:
    """Class shares of the similarity-weighted vote (knn_weights at `temperature`) of the k nearest with a known class
    (classes: per memory position, -1 unknown); `fallback` (the heads') where none is known."""
    positions, scores = near
    if not len(positions) or not (classes[positions] >= 0).any():
        return fallback
    return knn_vote_shares(scores[None, :], classes[positions], n_classes, k, temperature)[0]


def neighbour_classes(near: tuple[np.ndarray, np.ndarray], classes: np.ndarray, n_classes: int, k: int) -> np.ndarray:
    """Per class, how many of the k nearest labelled neighbours (with a known class) have it."""
    positions, scores = near
    known = classes[positions] >= 0 if len(positions) else np.zeros(0, bool)
    top = top_k(scores[known], k)
    return np.bincount(classes[positions[known]][top], minlength=n_classes)


def knn_value(
    near: tuple[np.ndarray, np.ndarray],
    values: np.ndarray,
    fallback: float,
    k: int = KNN_K,
    temperature: float | None = None,
    sizes: tuple[np.ndarray, np.ndarray] | None = None,
    width: float | None = None,
    slope: np.ndarray | None = None,
) -> float:
    """Similarity-weighted mean (knn_weights at `temperature`, and with a `width` by the update sizes in `sizes`: the
    query's update profile, and per memory position the labelled adapters') of the k nearest with a known value
    (values: per memory position, NaN unknown), plus with a `slope` the trend of value with the profile
    (embed.selection.metrics.knn_regress)."""
    positions, scores = near
    known = ~np.isnan(values[positions]) if len(positions) else np.zeros(0, bool)
    if not known.any():
        return fallback
    between = None if sizes is None else (np.array([sizes[0]]), sizes[1][positions[known]])
    found = knn_regress(scores[known][None, :], values[positions[known]], k, temperature, between, width, slope)
    return float(found[0])  # as choice.py scored
