"""A query's predictions from the predictors `zoo train` chose: each attribute's top classes with their calibrated
probabilities and the labelled neighbours that support them, each metric's value with its 90 % interval."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from embed.selection.calibration import is_sure
from embed.selection.metrics import top_k
from embed.serving.knn import knn_shares, knn_value, neighbour_classes
from embed.serving.results import ClassGuess, Confidence, MetricGuess
from zoo.domain.methods import KnnPredictor, SearchScore
from zoo.domain.sizes import update_profile

if TYPE_CHECKING:
    from embed.w2t.ensemble import W2TEnsemble
    from zoo.domain.canonical import CanonicalFactors

#: labelled neighbours counted as support of an attribute predicted by something other than a kNN
SUPPORT_K = 5

#: per similarity, the labelled neighbours of the query: (their positions in the model's memory, scores)
Near = Mapping[SearchScore, tuple[np.ndarray, np.ndarray]]


def attribute_guesses(
    model: W2TEnsemble, probs: Mapping[str, np.ndarray], knns: Mapping[str, KnnPredictor], near: Near, adapter_id: int | None
) -> tuple[dict[str, list[ClassGuess]], dict[str, Confidence]]:
    """Each attribute's top 3 classes (probability, supporting neighbours) and its confidence: the heads' shares or the
    chosen kNN's vote among `near`, calibrated; `adapter_id` a stored query's id, whose own label its vote leaves out."""
    attributes: dict[str, list[ClassGuess]] = {}
    confidence: dict[str, Confidence] = {}
    at_memory = np.flatnonzero(model.memory_ids == adapter_id) if adapter_id is not None else np.zeros(0, np.int64)
    for key, p in probs.items():
        classes = model.config.categorical[key]
        labels = model.memory_classes(key)
        knn = knns.get(key)
        k = knn.k if knn else SUPPORT_K
        around = near[knn.similarity if knn else model.search]
        shares = knn_shares(around, labels, len(classes), p[0], k, knn.temperature) if knn else p[0]
        # a labelled adapter's vote leaves its own label out (it is not its own neighbour): one label fewer
        own = bool(len(at_memory)) and labels[at_memory[0]] >= 0
        shares = model.calibrated(key, shares, own_label_left_out=knn is not None and own)
        support = neighbour_classes(around, labels, len(classes), k)
        order = top_k(shares, 3)
        attributes[key] = [{"value": classes[i], "probability": float(shares[i]), "neighbours": int(support[i])} for i in order]
        top, n = int(order[0]), int(support.sum())
        confidence[key] = {
            "sure": is_sure(float(shares[top]), int(support[top]), n, model.sure_from(key)),
            "neighbours": n,
            "agreeing": int(support[top]),
            "calibrated": key in model.calibration,
            "given": None,
            "agrees": None,
        }
    return attributes, confidence


def metric_guesses(
    model: W2TEnsemble,
    values: Mapping[str, np.ndarray],
    knns: Mapping[str, KnnPredictor],
    near: Near,
    factors: Mapping[str, CanonicalFactors],
) -> dict[str, MetricGuess]:
    """Each metric's value (the heads', or the chosen kNN's mean among `near`, clipped to its range) and 90 % interval.
    A kNN that weighs its neighbours by size, or follows the trend of value with the update's profile, reads the
    query's profile (from its `factors`) and the labelled adapters'."""
    metrics: dict[str, MetricGuess] = {}
    sized = any(knns[key].width is not None or knns[key].trend for key in values if key in knns)
    sizes = (update_profile(f.S for f in factors.values()), model.memory_profiles) if sized else None  # the query's, once
    for key, v in values.items():
        value = float(v[0])
        if (knn := knns.get(key)) is not None:
            slope = model.trend_slopes.get(key) if knn.trend else None
            found = knn_value(near[knn.similarity], model.memory_values[key], value, knn.k, knn.temperature, sizes, knn.width, slope)
            value = float(model.clip(key, np.array([found]))[0])
        low, high = interval(value, model.residual_std.get(key), *model.metric_range.get(key, (-math.inf, math.inf)))
        metrics[key] = {
            "value": value,
            "low": low,
            "high": high,
            "interval": 0.9 if low is not None else None,
            "predictor": model.predictor(key).kind,
            "method": model.predictor(key).name,
            "measured": None,
            "within": None,
        }
    return metrics


def interval(value: float, std: float | None, lowest: float, highest: float) -> tuple[float, float] | tuple[None, None]:
    """A predicted metric's 90 % interval from its held-out residuals' std, within the metric's range; none without
    residuals (never NaN in JSON)."""
    if std is None or not math.isfinite(std):
        return None, None
    return max(value - 1.645 * std, lowest), min(value + 1.645 * std, highest)
