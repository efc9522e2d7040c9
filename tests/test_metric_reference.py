"""A metric's kNN is chosen against a reference kNN: the best estimate among a hundred kNNs on a few dozen labelled
adapters is served only where choosing that way pays out of sample."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from scipy.stats import spearmanr

from embed.selection.choice import REFERENCE_WIDTH, choose_metric, metric_reference, spearman_rows
from embed.selection.metrics import KNN_K, knn_regress, trend_slope
from tests.task_trends import task_trends
from zoo.domain.exact_scores import EXACT_SCORES
from zoo.domain.methods import KnnPredictor, SearchScore

DW = SearchScore("dw")


@given(
    arrays(np.float64, st.tuples(st.integers(1, 6), st.integers(2, 12)), elements=st.sampled_from([0.0, 0.5, 1.0, 2.0, -1.0, 3.5])),
    st.data(),
)
def test_spearman_rows_is_each_rows_spearman_and_minus_one_for_a_constant(pred: np.ndarray, data: st.DataObject) -> None:
    truth = np.array(data.draw(st.lists(st.sampled_from([0.0, 1.0, 2.0, 5.0]), min_size=pred.shape[1], max_size=pred.shape[1])))
    expected = [spearmanr(row, truth).statistic if np.ptp(row) and np.ptp(truth) else -1.0 for row in pred]  # a constant ranks nothing
    np.testing.assert_allclose(spearman_rows(pred, truth), expected, atol=1e-12)


def test_the_reference_follows_the_searchs_training_free_score_sizes_and_the_trend_where_profiles_allow() -> None:
    """10 neighbours by the search's training-free score (dW where it has none), weighed by size at REFERENCE_WIDTH
    times the spread of the labelled sizes (1.25 here: the std of 1, 2 and 4), following the trend; without profiles,
    or sizes that do not spread, less of that."""
    values, sizes = np.array([0.1, 0.5, np.nan, 0.9]), np.array([1.0, 2.0, 3.0, 4.0])
    width = float(f"{REFERENCE_WIDTH * np.std([1.0, 2.0, 4.0]):.3g}")
    assert metric_reference(SearchScore("module", 0.5), EXACT_SCORES, values, sizes) == KnnPredictor(
        SearchScore("module"), KNN_K, width=width, trend=True
    )
    assert metric_reference(SearchScore("metric:search"), EXACT_SCORES, values, sizes) == KnnPredictor(DW, KNN_K, width=width, trend=True)
    assert metric_reference(DW, EXACT_SCORES, values, np.full(4, 2.0)) == KnnPredictor(DW, KNN_K, trend=True)
    assert metric_reference(DW, EXACT_SCORES, values, None) == KnnPredictor(DW, KNN_K)


def on_queries(m: KnnPredictor, sim: np.ndarray, values: np.ndarray, size: np.ndarray, labelled: np.ndarray, queries: np.ndarray) -> float:
    """How well kNN `m`, served from the labelled adapters, ranks the queries' values (Spearman)."""
    among = sim[np.ix_(labelled, labelled)]
    slope = trend_slope(among, values[labelled], size[labelled], m.k, m.temperature, m.width) if m.trend else None
    between = (size[queries], size[labelled])
    estimates = knn_regress(sim[np.ix_(queries, labelled)], values[labelled], m.k, m.temperature, between, m.width, slope)
    return float(spearmanr(estimates, values[queries]).statistic)


def test_the_best_estimate_among_many_knns_on_few_labels_is_served_only_where_it_pays() -> None:
    """Nine tasks of 8 labelled adapters and 16 queries, each task's values about its own level plus a trend with the
    update size, and a similarity that carries the task only faintly (as on docs-minilm-seeded, where a run's own head
    and seed blur it): the best estimate among the kNNs is noise, and it ranks the queries worse than the reference
    kNN, which the choice keeps."""
    kept, gains = 0, []
    for seed in range(10):
        z = task_trends(seed, tasks=9, per=24, levels=(0.5, 0.9), slope=0.05, spread=1.0, noise=0.05, blur=3.0)
        choice, _, _ = choose_metric(z.exact, DW, z.values[z.labelled], {}, z.folds, profiles=z.size[z.labelled])
        best = max((m for m in choice.scores if isinstance(m, KnnPredictor)), key=choice.scores.__getitem__)
        assert isinstance(choice.chosen, KnnPredictor)
        kept += choice.chosen == metric_reference(DW, EXACT_SCORES, z.values[z.labelled], z.size[z.labelled])
        ranks = [on_queries(m, z.sim, z.values, z.size, z.labelled, z.queries) for m in (choice.chosen, best)]
        gains.append(ranks[0] - ranks[1])
    assert kept >= 8 and np.mean(gains) > 0.02 and min(gains) > -0.05
