"""An update's profile (zoo.domain.sizes.update_profile) and the trend a metric's kNN follows over it: within a task a
run's value moves with how far it went, how many directions it wrote and how many modules it trained, and the size
alone says only the first."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import spearmanr

from embed.data.dataset import ExactScores
from embed.data.types import SpaceSchema, ZooAdapter
from embed.selection.metrics import TREND_RIDGE, knn_regress, trend_slope
from embed.serving.predictions import metric_guesses
from embed.w2t.ensemble import W2TEnsemble
from embed.w2t.model import W2T, W2TConfig
from zoo.domain.canonical import CanonicalFactors, canonicalize
from zoo.domain.methods import KnnPredictor, SearchScore
from zoo.domain.sizes import PROFILE, factors_size, update_profile

METRIC = "test_accuracy"
SHAPES = {"a": (12, 10), "b": (10, 12), "c": (8, 8)}


def _adapter(rng: np.random.Generator, scale: float = 1.0) -> dict[str, CanonicalFactors]:
    """Random canonical factors on a random non-empty subset of SHAPES' modules, ranks 1-4."""
    names = [m for m in SHAPES if rng.random() < 0.6] or ["a"]
    out = {}
    for name in names:
        o, i = SHAPES[name]
        r = int(rng.integers(1, 5))
        U, V = np.linalg.qr(rng.standard_normal((o, r)))[0], np.linalg.qr(rng.standard_normal((i, r)))[0]
        S = np.sort(rng.uniform(0.05, 3.0, r))[::-1] * scale
        out[name] = CanonicalFactors(torch.from_numpy(U), torch.from_numpy(S.copy()), torch.from_numpy(V))
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(0.01, 100.0))
def test_a_profile_is_read_alike_from_factors_and_for_the_training_choices_and_scales_as_its_columns_say(seed: int, scale: float) -> None:
    """The profile a query is served with equals the one the training choices read; its size is factors_size's; scaling
    every module by c adds 2 log c to the size and the module energy and log c to the leading value, and leaves the
    stable rank and the module count alone; the same update written at another rank (its factors padded) is the same."""
    rng = np.random.default_rng(seed)
    adapters = [_adapter(rng) for _ in range(4)]
    scores = ExactScores.of_factors([ZooAdapter(i, f"a{i}", a) for i, a in enumerate(adapters)], bank=False)
    given_profiles = scores.profiles_among([0, 1, 2, 3])
    own = np.array([update_profile(f.S for f in a.values()) for a in adapters])
    np.testing.assert_array_equal(given_profiles, own)
    assert own.shape == (4, len(PROFILE)) and np.isfinite(own).all()
    np.testing.assert_allclose(own[:, 0], [factors_size(f.S for f in a.values()) for a in adapters], rtol=1e-12)
    np.testing.assert_allclose(own[:, 4], np.log([len(a) for a in adapters]), rtol=1e-12)
    scaled = np.array([update_profile(f.S * scale for f in a.values()) for a in adapters])
    shift = np.log(scale) * np.array([2.0, 2.0, 0.0, 1.0, 0.0])
    np.testing.assert_allclose(scaled, own + shift, atol=1e-5)
    padded = np.array([update_profile(torch.cat([f.S, torch.zeros(2, dtype=f.S.dtype)]) for f in a.values()) for a in adapters])
    np.testing.assert_allclose(padded, own, atol=1e-6)


def test_an_empty_update_has_no_finite_profile() -> None:
    profile = update_profile([np.zeros(3)])
    assert profile[0] == -np.inf and np.isnan(profile[1:]).all()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), columns=st.integers(1, len(PROFILE)))
def test_the_trend_is_the_ridge_fit_of_the_residuals_on_the_profile_gaps(seed: int, columns: int) -> None:
    """Tasks whose values are their level plus β · profile exactly, and a similarity that is 1 within a task and 0
    across: an adapter's leave-one-out neighbours are its task's others, so its residual is β · its gap G from their
    mean profile, and the slope is the ridge fit (GᵀG + TREND_RIDGE · diag(GᵀG))⁻¹ GᵀG β."""
    rng = np.random.default_rng(seed)
    group = np.repeat(np.arange(4), 6)
    profiles = rng.normal(size=(len(group), columns))
    beta = rng.normal(size=columns)
    values = rng.uniform(0, 1, 4)[group] + profiles @ beta
    sim = (group[:, None] == group[None, :]).astype(float)
    gaps = np.array([profiles[i] - profiles[(group == group[i]) & (np.arange(len(group)) != i)].mean(axis=0) for i in range(len(group))])
    gram = gaps.T @ gaps
    expected = np.linalg.solve(gram + TREND_RIDGE * np.diag(np.diag(gram)), gram @ beta)
    np.testing.assert_allclose(trend_slope(sim, values, profiles, k=5), expected, rtol=1e-7, atol=1e-10)


def test_the_trend_over_the_profile_ranks_a_tasks_runs_that_the_size_alone_does_not() -> None:
    """Nine tasks of 8 labelled runs and 16 queries whose values are their task's level plus a part that follows the
    stable rank (the profile's third column) and not the size, and a similarity that carries the task: a kNN's
    neighbours vote their task's level alike, the trend over the size alone reads nothing, and the trend over the
    profile ranks the queries far better."""
    gains = []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        group = np.repeat(np.arange(9), 24)
        profiles = rng.normal(size=(len(group), len(PROFILE)))
        values = rng.uniform(0.5, 0.9, 9)[group] + 0.05 * profiles[:, 2] + 0.01 * rng.normal(size=len(group))
        x = rng.normal(size=(9, 16))[group] + 0.3 * rng.normal(size=(len(group), 16))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        sim = x @ x.T
        labelled = np.concatenate([np.flatnonzero(group == g)[:8] for g in range(9)])
        queries = np.setdiff1d(np.arange(len(group)), labelled)
        among, to_labelled = sim[np.ix_(labelled, labelled)], sim[np.ix_(queries, labelled)]
        ranks = []
        for p in (profiles[:, :1], profiles):  # the size alone, then the whole profile
            slope = trend_slope(among, values[labelled], p[labelled])
            served = knn_regress(to_labelled, values[labelled], sizes=(p[queries], p[labelled]), slope=slope)
            ranks.append(spearmanr(served, values[queries]).statistic)
        gains.append(ranks[1] - ranks[0])
    assert min(gains) > 0.03 and np.mean(gains) > 0.1


def _ensemble(profiles: np.ndarray, slope: np.ndarray) -> W2TEnsemble:
    """A one-member ensemble whose memory holds 6 labelled adapters' values and update profiles, predicting METRIC by
    a module cosine 3-NN that follows the trend with `slope`."""
    schema = SpaceSchema("tiny", (("m", 8, 8),))
    config = W2TConfig(schema.type_shapes(), n_layers=1, regression=[METRIC])
    emb = W2TEnsemble([W2T(config)], schema, 2, {METRIC: (0.5, 0.1)}, "supervised", metric_range={METRIC: (0.0, 1.0)})
    emb.memory_values = {METRIC: np.array([0.50, 0.55, 0.60, 0.65, 0.70, 0.75])}
    emb.memory_profiles = profiles
    emb.memory_ids = np.arange(1, 7)
    emb.predictors = {METRIC: KnnPredictor(SearchScore("module"), 3, trend=True)}
    emb.trend_slopes = {METRIC: slope}
    return emb


def test_a_checkpoint_serves_the_trend_over_the_profile_and_one_from_before_over_the_size(tmp_path: Path) -> None:
    """`zoo predict` serves the neighbours' mean plus the slope times the query's profile less theirs; a checkpoint
    from before profiles (sizes alone in its memory, one slope) is served over the size, as it was."""
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(0)
    B, A = torch.randn(8, 2, generator=gen, dtype=torch.float64), torch.randn(2, 8, generator=gen, dtype=torch.float64)
    factors = {"m": canonicalize(A, 3.0 * B)}
    query = update_profile(f.S for f in factors.values())
    near = {SearchScore("module"): (np.array([0, 2, 4, 5]), np.array([0.9, 0.8, 0.7, 0.1]))}  # 3 nearest: 0, 2, 4
    profiles = np.random.default_rng(1).normal(size=(6, len(PROFILE)))
    slope = np.array([0.01, -0.02, 0.03, 0.0, 0.01])
    _ensemble(profiles, slope).save(tmp_path / "now")
    served = W2TEnsemble.load(tmp_path / "now")
    np.testing.assert_array_equal(served.memory_profiles, profiles)
    np.testing.assert_array_equal(served.trend_slopes[METRIC], slope)
    w = np.array([0.9, 0.8, 0.7]) + 1e-6
    mean_value = (w @ [0.50, 0.60, 0.70]) / w.sum()
    gap = query - (w @ profiles[[0, 2, 4]]) / w.sum()
    guess = metric_guesses(served, {METRIC: np.array([0.5])}, served.predictors, near, factors)[METRIC]
    assert guess["value"] == pytest.approx(float(np.clip(mean_value + gap @ slope, 0, 1)), abs=1e-12)

    sizes = np.array([1.0, 1.5, 2.0, 2.5, 3.0, 3.5])  # a checkpoint from before: the sizes, one slope
    _ensemble(sizes[:, None], np.array([0.04])).save(tmp_path / "before")
    memory = load_file(str(tmp_path / "before" / "memory.safetensors"))
    memory["sizes"] = memory.pop("profiles")[:, 0].contiguous()
    save_file(memory, str(tmp_path / "before" / "memory.safetensors"))
    meta_path = tmp_path / "before" / "embedder.json"
    meta = json.loads(meta_path.read_text())
    meta["trend_slopes"] = {METRIC: 0.04}
    meta_path.write_text(json.dumps(meta))
    before = W2TEnsemble.load(tmp_path / "before")
    assert before.trend_slopes[METRIC].tolist() == [0.04] and before.memory_profiles.shape == (6, 1)
    guess = metric_guesses(before, {METRIC: np.array([0.5])}, before.predictors, near, factors)[METRIC]
    mean_size = (w @ sizes[[0, 2, 4]]) / w.sum()
    assert guess["value"] == pytest.approx(min(mean_value + 0.04 * (query[0] - mean_size), 1.0), abs=1e-12)
