"""A metric's kNN that follows the trend of value with update size (KnnPredictor.trend), as `zoo predict` serves it
from a checkpoint: the neighbours' weighed mean plus the checkpoint's slope times the query's size less theirs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from embed.data.types import SpaceSchema
from embed.serving.predictions import metric_guesses
from embed.w2t.ensemble import W2TEnsemble
from embed.w2t.model import W2T, W2TConfig
from zoo.domain.canonical import canonicalize
from zoo.domain.methods import KnnPredictor, SearchScore
from zoo.domain.sizes import factors_size

METRIC = "test_accuracy"


def _ensemble(trend: bool, slope: float) -> W2TEnsemble:
    """A one-member ensemble whose memory holds 6 labelled adapters' values and sizes, predicting METRIC by a module
    cosine 3-NN (following the trend or not), with `slope` kept as the checkpoint keeps it."""
    schema = SpaceSchema("tiny", (("m", 8, 8),))
    config = W2TConfig(schema.type_shapes(), n_layers=1, regression=[METRIC])
    emb = W2TEnsemble([W2T(config)], schema, 2, {METRIC: (0.5, 0.1)}, "supervised", metric_range={METRIC: (0.0, 1.0)})
    emb.memory_values = {METRIC: np.array([0.50, 0.55, 0.60, 0.65, 0.70, 0.75])}
    emb.memory_profiles = np.array([[1.0], [1.5], [2.0], [2.5], [3.0], [3.5]])
    emb.memory_ids = np.arange(1, 7)
    emb.predictors = {METRIC: KnnPredictor(SearchScore("module"), 3, None, None, trend)}
    emb.trend_slopes = {METRIC: np.array([slope])} if trend else {}
    return emb


def _query(scale: float) -> dict:
    gen = torch.Generator().manual_seed(0)
    B, A = torch.randn(8, 2, generator=gen, dtype=torch.float64), torch.randn(2, 8, generator=gen, dtype=torch.float64)
    return {"m": canonicalize(A, scale * B)}


def test_a_trended_knn_serves_the_neighbours_mean_plus_the_slope_times_the_size_gap(tmp_path: Path) -> None:
    factors = _query(3.0)
    size = factors_size(f.S for f in factors.values())
    near = {SearchScore("module"): (np.array([0, 2, 4, 5]), np.array([0.9, 0.8, 0.7, 0.1]))}  # 3 nearest: 0, 2, 4
    values = {METRIC: np.array([0.5])}  # the heads' value, the fallback
    emb = _ensemble(True, 0.04)
    emb.save(tmp_path / "ckpt")
    loaded = W2TEnsemble.load(tmp_path / "ckpt")
    assert loaded.predictors == emb.predictors and loaded.trend_slopes[METRIC].tolist() == [0.04]
    served = metric_guesses(loaded, values, {METRIC: loaded.predictors[METRIC]}, near, factors)[METRIC]
    plain = metric_guesses(_ensemble(False, 0.0), values, {METRIC: KnnPredictor(SearchScore("module"), 3)}, near, factors)[METRIC]
    w = np.array([0.9, 0.8, 0.7]) + 1e-6
    mean_value, mean_size = (w @ [0.50, 0.60, 0.70]) / w.sum(), (w @ [1.0, 2.0, 3.0]) / w.sum()
    assert plain["value"] == pytest.approx(mean_value, abs=1e-12)
    assert served["value"] == pytest.approx(min(mean_value + 0.04 * (size - mean_size), 1.0), abs=1e-12)
    assert served["method"] == "knn module k=3 trend" and abs(size - mean_size) > 0.5  # the query's gap moves it
