"""The clustered bootstrap of `zoo eval`'s paired intervals (embed/training/intervals.py) and the cross-fitted choice of the
search regret's fixed candidate (embed/training/evaluate.py): invariants that hold for any input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy.stats import bootstrap

from embed.training.eval_summary import cross_fitted_picks, cross_fitted_regret
from embed.training.evaluate import SplitQueries
from embed.training.intervals import clustered_bootstrap

finite = st.floats(-100, 100, allow_nan=False)
#: clusters of values: each a non-empty list, at least two of them
clusters = st.lists(st.lists(finite, min_size=1, max_size=6), min_size=2, max_size=8)


def labelled(groups: list[list[float]]) -> tuple[np.ndarray, list[int]]:
    """The values of `groups` in one array, and the group of each."""
    return np.array([v for g in groups for v in g]), [i for i, g in enumerate(groups) for _ in g]


@settings(max_examples=40, deadline=None)
@given(clusters, st.integers(1, 4))
def test_identical_inputs_give_a_zero_width_interval_at_zero(groups: list[list[float]], tasks: int) -> None:
    scores, splits = labelled(groups)
    task_of = [i % tasks for i in range(len(scores))]
    for factors in ([splits], [splits, task_of]):
        found = clustered_bootstrap(scores - scores, factors, resamples=200)
        assert found.mean == found.low == found.high == 0.0 and not found.clear


@settings(max_examples=40, deadline=None)
@given(clusters, finite)
def test_a_constant_shift_lies_in_its_interval(groups: list[list[float]], shift: float) -> None:
    before, splits = labelled(groups)
    after = before + shift  # another method, better (or worse) by `shift` on every query
    found = clustered_bootstrap(after - before, [splits, [i % 3 for i in range(len(before))]], resamples=200)
    tolerance = 1e-9 * (1 + np.abs(after).max())
    assert found.low - tolerance <= shift <= found.high + tolerance
    assert found.mean == pytest.approx(shift, abs=tolerance) and found.high - found.low <= 2 * tolerance


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(finite, min_size=1, max_size=4), min_size=3, max_size=6), st.booleans())
def test_more_clusters_like_these_narrow_the_interval(groups: list[list[float]], crossed: bool) -> None:
    """Each cluster copied three times as new clusters: the same spread between clusters, four times as many of them;
    the interval narrows (by about half). One way (splits alone), or crossed (new splits and new tasks: a factor
    whose clusters are not copied keeps its own spread, so only a design where both factors grow must narrow)."""
    values, splits = labelled(groups)
    tasks = [i % 2 for i in range(len(values))]
    width = lambda found: found.high - found.low  # noqa: E731

    def factors(copies: int) -> list[list[int]]:
        split_of = [s + copy * len(groups) for copy in range(copies) for s in splits]
        task_of = [t + 2 * copy for copy in range(copies) for t in tasks]
        return [split_of, task_of] if crossed else [split_of]

    few = clustered_bootstrap(values, factors(1))
    assume(width(few) > 1e-6 * (1 + np.abs(values).max()))
    many = clustered_bootstrap(np.tile(values, 4), factors(4))
    assert width(many) < width(few)


def test_one_value_per_cluster_is_the_ordinary_bootstrap() -> None:
    """Clusters of one value each: the interval is scipy's percentile bootstrap of the mean (up to resampling noise)."""
    values = np.random.default_rng(3).normal(0.2, 1.0, 60)
    ours = clustered_bootstrap(values, [range(len(values))], resamples=4000)
    theirs = bootstrap((values,), np.mean, n_resamples=4000, method="percentile", random_state=1).confidence_interval
    assert ours.mean == pytest.approx(values.mean())
    assert ours.low == pytest.approx(theirs.low, abs=0.04) and ours.high == pytest.approx(theirs.high, abs=0.04)


def test_a_cluster_counts_once_however_many_values_it_has() -> None:
    """Ten clusters, one of them a thousand copies of its value: the interval is as wide as ten clusters make it,
    not as narrow as a thousand independent values would."""
    rng = np.random.default_rng(0)
    means = rng.normal(0, 1, 10)
    values = np.concatenate([np.full(1000 if i == 0 else 1, m) for i, m in enumerate(means)])
    labels = [0] * 1000 + list(range(1, 10))
    clustered = clustered_bootstrap(values, [labels])
    independent = clustered_bootstrap(values, [range(len(values))])
    assert clustered.high - clustered.low > 10 * (independent.high - independent.low)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        clustered_bootstrap([], [[]])
    with pytest.raises(ValueError, match="2 labels for 3 values"):
        clustered_bootstrap([1.0, 2.0, 3.0], [[0, 1]])
    with pytest.raises(ValueError, match="two splits or more"):
        cross_fitted_picks(np.zeros((1, 3)), np.ones(1))


#: candidates' means on 2 to 6 splits (3 candidates), and one of the splits
splits_and_one = st.integers(2, 6).flatmap(
    lambda n: st.tuples(st.lists(st.lists(finite, min_size=3, max_size=3), min_size=n, max_size=n), st.integers(0, n - 1))
)


@settings(max_examples=40, deadline=None)
@given(splits_and_one, st.lists(finite, min_size=3, max_size=3))
def test_cross_fitting_never_looks_at_the_split_it_scores(case: tuple[list[list[float]], int], other: list[float]) -> None:
    rows, scored = case
    means, sizes = np.array(rows), np.arange(1, len(rows) + 1, dtype=float)
    changed = means.copy()
    changed[scored] = other  # whatever the scored split says of the candidates
    assert cross_fitted_picks(changed, sizes)[scored] == cross_fitted_picks(means, sizes)[scored]


def test_cross_fitted_and_hindsight_picks_differ_where_one_split_decides() -> None:
    """Candidate `a` wins split 0 by far, `b` wins the two others by a little: in hindsight, over all three splits,
    `a` is the best fixed candidate; cross-fitted, split 0 is scored against `b`, chosen on splits 1 and 2, and the
    regret is `b`'s measure there minus the served one's, per query."""
    per_split = [{"a": [1.0, 1.0], "b": [0.0, 0.0]}, {"a": [0.4, 0.4], "b": [0.5, 0.5]}, {"a": [0.4, 0.4], "b": [0.5, 0.5]}]
    means = np.array([[np.mean(s["a"]), np.mean(s["b"])] for s in per_split])
    assert int(np.argmax(means.mean(axis=0))) == 0  # hindsight: a
    assert cross_fitted_picks(means, np.full(3, 2.0)) == [1, 0, 0]  # split 0: b (from 1, 2); splits 1, 2: a (split 0 outweighs)

    def split(seed: int, scores: dict[str, list[float]]) -> dict[str, object]:
        candidates = {name: {k: np.array(v) for k in ("hit@1", "mrr", "ndcg@10")} for name, v in scores.items()}
        return {"seed": seed, "per_query": SplitQueries(["x", "y"], {}, candidates, served="a")}

    regret = cross_fitted_regret([split(seed, s) for seed, s in enumerate(per_split)])
    for key in ("hit@1", "mrr", "ndcg@10"):
        assert [(s["fixed"], s["regret"]) for s in regret[key]["splits"]] == [("b", -1.0), ("a", 0.0), ("a", 0.0)]
        assert regret[key]["mean"] == pytest.approx(-1 / 3) and regret[key]["low"] <= -1 / 3 <= regret[key]["high"]
    assert cross_fitted_regret([split(0, per_split[0])]) == {}  # one split: nothing to choose on
