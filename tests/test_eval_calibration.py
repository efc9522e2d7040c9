"""`zoo eval`'s reading of the served task probabilities' calibration (embed.training.eval_summary.calibration): the
splits' mean error, the error of all their queries pooled, and the floor a calibrated predictor shows by chance."""

from __future__ import annotations

import numpy as np
import pytest

from embed.selection.calibration import expected_calibration_error
from embed.training.eval_summary import calibration
from embed.training.evaluate import CONFIDENCE, SplitQueries


def _splits(overconfidence: float, splits: int = 10, queries: int = 164, seed: int = 0) -> list[dict]:
    """Splits whose answers are given at probabilities in [0.3, 1) and right with that probability less
    `overconfidence`, as embed.training.evaluate.evaluate reports them (the default's attr_ece and its per-query scores)."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(splits):
        confidence = rng.uniform(0.3, 1.0, queries)
        right = (rng.random(queries) < confidence - overconfidence).astype(np.float64)
        per = {"default": {"attr_acc": right, CONFIDENCE: confidence}}
        ece = expected_calibration_error(confidence, right)
        out.append({"seed": s, "methods": {"default": {"attr_ece": ece}}, "per_query": SplitQueries(["t"] * queries, per, {}, "dw")})
    return out


def test_a_calibrated_predictor_sits_at_the_floor_and_pools_near_zero() -> None:
    found = calibration(_splits(0.0))
    assert found is not None and (found["queries"], found["splits"]) == (1640, 10)
    assert found["floor"] > 0.04  # 164 queries a split: an error above 0 by chance alone
    assert found["splits_mean"] == pytest.approx(found["floor"], abs=0.015)
    assert found["pooled"] < found["floor"] / 1.5  # ten times the queries: a third of the chance error


def test_an_overconfident_predictor_stands_above_the_floor_pooled_or_not() -> None:
    found = calibration(_splits(0.2))
    assert found is not None
    assert found["pooled"] == pytest.approx(0.2, abs=0.03) and found["splits_mean"] > found["floor"] + 0.1


def test_splits_without_the_per_query_probabilities_give_none() -> None:
    old = _splits(0.0, splits=2)
    del old[1]["per_query"].methods["default"][CONFIDENCE]
    assert calibration(old) is None and calibration(_splits(0.0, splits=2)) is not None
