"""Methods chosen out of fold (embed/selection/choice.py): the best expected quality, each estimate shrunk toward the
training-free reference by its standard error; with few labels the exact scores stay."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy.stats import spearmanr

from embed.selection.calibration import expected_calibration_error
from embed.selection.choice import (
    HALVES,
    KNN_KS,
    KNN_TEMPERATURES,
    MIN_ITEMS,
    Fold,
    best_expected,
    choose_attribute,
    choose_metric,
    knn_similarities,
    knn_similarity,
    prototype_predictions,
    readout_predictions,
    scores_for,
    sized_knns,
)
from embed.selection.metrics import KNN_K, TREND_RIDGE, knn_regress, knn_vote_shares, knn_weights, retrieval_per_query, trend_slope
from embed.selection.search_choice import (
    MIX_WEIGHTS,
    RERANK_TOPS,
    SURE,
    choose_search,
    held_out_w2t,
    mix_candidates,
    search_candidates,
    self_excluded,
    staged_over,
)
from tests.task_trends import task_trends
from zoo.domain.exact_scores import EXACT_SCORES
from zoo.domain.methods import HEAD, LOGREG, NEIGHBOURS, PROTOTYPE, KnnPredictor, SearchScore, fitted_score

DW, W2T = SearchScore("dw"), SearchScore("dw", 1.0)
EXACT = [SearchScore(s) for s in EXACT_SCORES]


@given(st.sampled_from(EXACT_SCORES), st.sampled_from((0.0, *MIX_WEIGHTS)))
def test_every_search_candidate_has_its_own_name(exact: str, weight: float) -> None:
    """Candidates differ by name: W2T alone mixes in no exact score, so it is one candidate whatever `exact` says."""
    score = SearchScore(exact, weight)
    assert SearchScore.parse(score.name) == score and score.w2t_weight == weight
    assert score.exact == exact or (weight == 1 and score == W2T)


@given(st.lists(st.lists(st.floats(0, 1), min_size=12, max_size=12), min_size=2, max_size=5))
def test_best_expected_takes_the_best_estimate_only_where_choosing_so_pays(columns: list[list[float]]) -> None:
    table = np.array(columns).T  # 12 items × candidates; candidate 0 is the reference
    names = [f"c{i}" for i in range(table.shape[1])]
    score = lambda c, items: float(table[items, names.index(c)].mean())  # noqa: E731
    chosen, gain = best_expected(names[1:], "c0", score, len(table))
    best = names[int(np.argmax(table.mean(axis=0)))]
    assert chosen == (best if gain > 0 else "c0")
    halves = []
    rng = np.random.default_rng(0)
    for _ in range(HALVES):  # the replay, done by hand
        perm = rng.permutation(12)
        pick = names[int(np.argmax(table[perm[:6]].mean(axis=0)))]
        halves.append(score(pick, perm[6:]) - score("c0", perm[6:]))
    assert np.isclose(gain, np.mean(halves))


def test_a_steady_gain_pays_and_noise_does_not() -> None:
    rng = np.random.default_rng(0)
    reference = rng.uniform(size=200)
    steady = reference + 0.05
    noisy = [reference + rng.normal(scale=0.3, size=200) for _ in range(20)]  # twenty candidates worth the reference
    table = np.stack([reference, steady, *noisy], axis=1)
    names = list(range(table.shape[1]))
    score = lambda c, items: float(table[items, c].mean())  # noqa: E731
    chosen, gain = best_expected(names, 0, score, 200)
    assert chosen == 1 and 0 < gain < 0.05  # it pays, less than its own gain: on halves a noisy one sometimes looks best
    noise_only = [0, *names[2:]]
    chosen, gain = best_expected(noise_only, 0, score, 200)
    assert chosen == 0 and gain < 0  # the best of twenty noisy estimates loses on the other halves


@given(st.lists(st.floats(-1, 1), min_size=12, max_size=40), st.floats(0.5, 1.0))
def test_a_sure_pick_must_gain_on_that_share_of_the_halves(diffs: list[float], sure: float) -> None:
    """With `sure`, the pick is made where the mean gain on the other halves is positive and the pick gained on at
    least that share of them (the replay, done by hand); without it, a positive mean gain is enough."""
    table = np.stack([np.zeros(len(diffs)), np.array(diffs)], axis=1)
    score = lambda c, items: float(table[items, c].mean())  # noqa: E731
    chosen, gain = best_expected([1], 0, score, len(diffs), sure=sure)
    halves = []
    rng = np.random.default_rng(0)
    n = len(diffs)
    for _ in range(HALVES):
        perm = rng.permutation(n)
        pick = 1 if table[perm[: n // 2], 1].mean() > 0 else 0
        halves.append(score(pick, perm[n // 2 :]))
    assert np.isclose(gain, np.mean(halves))
    assert chosen == (1 if np.mean(halves) > 0 and np.mean(np.array(halves) > 0) >= sure else 0)
    assert best_expected([1], 0, score, len(diffs))[0] == (1 if np.mean(halves) > 0 else 0)


def test_a_gain_on_most_halves_is_not_sure() -> None:
    """A candidate better on three items of five (by 1) and worse on two (by 1) gains in the mean: picked, unless it
    must gain on 95 % of the halves."""
    diffs = np.tile([1.0, 1.0, 1.0, -1.0, -1.0], 8)
    table = np.stack([np.zeros(len(diffs)), diffs], axis=1)
    score = lambda c, items: float(table[items, c].mean())  # noqa: E731
    assert best_expected([1], 0, score, len(diffs))[0] == 1
    assert best_expected([1], 0, score, len(diffs), sure=0.95)[0] == 0


def _onehot(i: int, n: int) -> np.ndarray:
    return np.eye(n)[i]


def _zoo(n_tasks: int, per_task: int, w2t_noise: float, seed: int = 0) -> tuple[dict[str, np.ndarray], list[str], list[Fold]]:
    """Exact scores that carry the task weakly (a noisy cosine) and W2T embeddings that carry it with `w2t_noise`."""
    rng = np.random.default_rng(seed)
    tasks = [f"t{i}" for i in range(n_tasks) for _ in range(per_task)]
    centers = rng.normal(size=(n_tasks, 8))
    x = np.repeat(centers, per_task, axis=0) + 2.5 * rng.normal(size=(len(tasks), 8))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    exact = {"dw": x @ x.T, "module": x @ x.T * 0.9, "input_gram": x @ x.T * 0.8}
    folds = []
    perm = rng.permutation(len(tasks))
    for part in np.array_split(perm, 4):
        z = np.repeat(centers, per_task, axis=0) + w2t_noise * rng.normal(size=(len(tasks), 8))
        z /= np.linalg.norm(z, axis=1, keepdims=True)
        folds.append(Fold(sorted(part.tolist()), sorted(set(range(len(tasks))) - set(part.tolist())), z))
    return exact, tasks, folds


def test_search_takes_w2t_where_it_retrieves_better_and_keeps_dw_where_it_is_noise() -> None:
    exact, tasks, folds = _zoo(6, 12, w2t_noise=0.05)  # W2T separates the tasks, the exact score barely
    chosen = choose_search(exact, tasks, folds)
    assert chosen.chosen not in EXACT and chosen.scores[chosen.chosen] > chosen.scores[DW] and "best expected" in chosen.reason
    assert set(mix_candidates()) <= set(chosen.scores) <= set(search_candidates())  # every exact score, alone and mixed, is weighed
    picks = [choose_search(*_zoo(6, 12, w2t_noise=20.0, seed=seed)) for seed in range(10)]  # W2T is noise
    assert sum(p.chosen == DW for p in picks) >= 8  # dW stays but where a noisy mix happens to pay on held-out halves
    assert all("stays" in p.reason for p in picks if p.chosen == DW)
    exact, tasks, folds = _zoo(2, 2, w2t_noise=0.05)  # four labels: too few to tell
    assert MIN_ITEMS > 4 and choose_search(exact, tasks, folds).chosen == DW


def _memorising_zoo(
    seed: int, n_tasks: int = 6, per_task: int = 12, queries: int = 30
) -> tuple[dict[str, np.ndarray], list[str], list[Fold], Callable[[SearchScore], float]]:
    """Exact scores that carry the task, and W2T members that put their training rows on their task's centre but embed
    an adapter they never saw with little of its task (as W2T does where it overfits few labels); with the mean
    MRR + nDCG@10 of a search score over fresh queries, each searching the others (no member saw any)."""
    rng = np.random.default_rng(seed)
    cx, cz = rng.normal(size=(n_tasks, 16)), rng.normal(size=(n_tasks, 16))

    def unit(a: np.ndarray) -> np.ndarray:
        return a / np.linalg.norm(a, axis=1, keepdims=True)

    def draw(per: int) -> tuple[list[str], np.ndarray, np.ndarray]:
        t = np.repeat(np.arange(n_tasks), per)
        return [f"t{i}" for i in t], unit(cx[t] + 0.8 * rng.normal(size=(len(t), 16))), unit(0.3 * cz[t] + rng.normal(size=(len(t), 16)))

    tasks, x, unseen = draw(per_task)
    centres = np.repeat(unit(cz), per_task, axis=0)
    folds = []
    for part in np.array_split(rng.permutation(len(tasks)), 4):
        z = centres.copy()
        z[part] = unseen[part]
        folds.append(Fold(sorted(part.tolist()), sorted(set(range(len(tasks))) - set(part.tolist())), z))
    q_tasks, qx, qz = draw(queries)

    def on_queries(score: SearchScore) -> float:
        ranking = score.ranking(qx @ qx.T, qz @ qz.T, np.eye(len(q_tasks), dtype=bool))
        per = retrieval_per_query(ranking, q_tasks, q_tasks, list(range(len(q_tasks))))
        return float((per["mrr"] + per["ndcg@10"]).mean())

    return dict.fromkeys(EXACT_SCORES, x @ x.T), tasks, folds, on_queries


def test_a_w2t_mix_that_only_knows_its_training_rows_is_not_served() -> None:
    """Against the labelled adapters a held-out one finds its task's training rows gathered on one point, where a query
    finds unlabelled adapters no member saw: W2T there estimates above what queries get of it, and the plain guard
    served a W2T mix on 18 of these 20 zoos. Made to pay on SURE of the held-out halves, a mix is served on at most a
    few, and the queries lose nothing by that."""
    mixed, served, unmixed = 0, [], []
    for seed in range(20):
        exact, tasks, folds, on_queries = _memorising_zoo(seed)
        chosen = choose_search(exact, tasks, folds).chosen
        mixed += chosen.w2t_weight > 0
        served.append(on_queries(chosen))
        unmixed.append(on_queries(DW))
    assert mixed <= 6 and np.mean(served) >= np.mean(unmixed) - 0.01


def test_attribute_and_metric_predictors_default_to_the_knn() -> None:
    exact, tasks, folds = _zoo(4, 10, w2t_noise=0.05)
    knns = [KnnPredictor(s, k) for s in knn_similarities(DW) for k in KNN_KS]
    classes = sorted(set(tasks))
    good_heads = {r: _onehot(classes.index(t), len(classes)) for r, t in enumerate(tasks)}
    choice, hits, _ = choose_attribute(exact, DW, tasks, classes, {HEAD: good_heads}, folds)
    best_knn = max(hits[k].mean() for k in knns)
    assert hits[HEAD].mean() == 1.0 and (choice.chosen == HEAD) == (best_knn < 1.0)  # a perfect head pays on any half
    wrong_heads = {r: _onehot(0, len(classes)) for r in range(len(tasks))}
    choice, hits, _ = choose_attribute(exact, DW, tasks, classes, {HEAD: wrong_heads}, folds)
    assert choice.chosen in knns and hits[choice.chosen].mean() == max(hits[k].mean() for k in knns)
    rng = np.random.default_rng(1)
    values = np.array([float(t[1:]) for t in tasks]) + 0.1 * rng.normal(size=len(tasks))
    perfect = {r: float(v) for r, v in enumerate(values)}
    noise = {r: float(v) for r, v in enumerate(rng.normal(size=len(tasks)))}
    choice, pred, truth = choose_metric(exact, W2T, values, {HEAD: perfect, NEIGHBOURS: noise}, folds)
    assert len(pred) == len(truth) == len(tasks)
    assert choice.chosen == HEAD or choice.scores[choice.chosen] >= choice.scores[HEAD] - 0.1
    choice, _, _ = choose_metric(exact, W2T, values, {HEAD: noise}, folds)
    assert isinstance(choice.chosen, KnnPredictor) and choice.scores[choice.chosen] > choice.scores[HEAD]
    assert choice.scores[choice.chosen] == max(v for k, v in choice.scores.items() if isinstance(k, KnnPredictor))


def test_the_knn_takes_few_neighbours_when_each_class_has_few_labels() -> None:
    """Three labelled adapters per class, all alike (a shared direction) but nearest to their own class: 10
    neighbours outvote the two of its class, one neighbour never does; the kNN's k is chosen out of fold."""
    rng = np.random.default_rng(0)
    n_classes, per = 8, 3
    labels = [f"c{c}" for c in range(n_classes) for _ in range(per)]
    x = 3 + np.repeat(rng.normal(size=(n_classes, 16)), per, axis=0) + 0.5 * rng.normal(size=(n_classes * per, 16))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    exact = {"dw": x @ x.T, "module": x @ x.T, "input_gram": x @ x.T}
    z = np.eye(len(labels))
    folds = [Fold(list(range(i, len(labels), 4)), [r for r in range(len(labels)) if (r - i) % 4], z) for i in range(4)]
    choice, hits, _ = choose_attribute(exact, DW, labels, sorted(set(labels)), {}, folds)
    assert isinstance(choice.chosen, KnnPredictor) and choice.chosen.k < KNN_K
    assert hits[choice.chosen].mean() > hits[KnnPredictor(DW, KNN_K)].mean()
    values = np.array([float(label[1:]) for label in labels])
    choice, _, _ = choose_metric(exact, DW, values, {}, folds)
    assert isinstance(choice.chosen, KnnPredictor) and choice.chosen.k < KNN_K


def test_a_metric_knn_weighs_its_nearest_more_where_the_similarities_sit_close() -> None:
    """Groups of 3 and of 12 labelled adapters, each group's values about its own level, and similarities that carry
    the group but all lie within a few hundredths of 0.9 (as the input Gram's do): max(s, 0) weighs the k nearest
    alike, so one k pulls the small groups' values toward the others' or leaves the large groups' noise
    unaveraged; a softmax at a small temperature follows the nearest and still averages a close group. The choice
    takes a temperature by Spearman out of fold, and on held-out queries of the same groups it predicts better than
    the best kNN without one."""
    sizes = np.array([3] * 8 + [12] * 4)
    picked, gains = 0, []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        group = np.repeat(np.arange(len(sizes)), 2 * sizes)  # half labelled, half queries
        values = rng.uniform(0, 1, len(sizes))[group] + 0.15 * rng.normal(size=len(group))
        x = rng.normal(size=(len(sizes), 16))[group] + 0.6 * rng.normal(size=(len(group), 16))
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        sim = 0.9 + 0.05 * (x @ x.T)
        labelled = np.concatenate([np.flatnonzero(group == g)[:size] for g, size in enumerate(sizes)])
        queries = np.setdiff1d(np.arange(len(group)), labelled)
        n = len(labelled)
        parts = np.array_split(rng.permutation(n), 4)
        folds = [Fold(sorted(part.tolist()), sorted(set(range(n)) - set(part.tolist())), np.eye(n)) for part in parts]
        exact = {score: sim[np.ix_(labelled, labelled)] for score in EXACT_SCORES}
        choice, _, _ = choose_metric(exact, DW, values[labelled], {}, folds)
        chosen = choice.chosen
        assert isinstance(chosen, KnnPredictor)
        flat = max((m for m in choice.scores if isinstance(m, KnnPredictor) and m.temperature is None), key=choice.scores.__getitem__)
        picked += chosen.temperature in KNN_TEMPERATURES
        to_labelled = sim[np.ix_(queries, labelled)]
        served, untempered = (knn_regress(to_labelled, values[labelled], m.k, m.temperature) for m in (chosen, flat))
        gains.append(spearmanr(served, values[queries]).statistic - spearmanr(untempered, values[queries]).statistic)
    assert picked >= 8 and np.mean(gains) > 0


def test_a_metric_knn_reads_the_update_size_where_within_a_task_the_size_says_how_far_a_run_went() -> None:
    """Tasks of 16 adapters (8 labelled), each task's values about its own level plus a part that grows with the run's
    update size (log energy), and a similarity that carries the task alone: a kNN's neighbours of one task all vote
    alike, so it ranks the task's runs at random; weighed by size, or following the trend of value with size, it ranks
    them. The choice takes such a kNN out of fold, and on held-out queries it ranks better than the best kNN that reads
    no size."""
    picked, gains = 0, []
    for seed in range(10):
        z = task_trends(seed, tasks=8, per=16, levels=(0.0, 1.0), slope=0.08, spread=2.0, noise=0.02, blur=0.5)
        sim, values, size, labelled, queries = z.sim, z.values, z.size, z.labelled, z.queries
        choice, _, _ = choose_metric(z.exact, DW, values[labelled], {}, z.folds, profiles=size[labelled])
        chosen = choice.chosen
        assert isinstance(chosen, KnnPredictor)
        reads_no_size = [m for m in choice.scores if isinstance(m, KnnPredictor) and m.width is None and not m.trend]
        plain = max(reads_no_size, key=choice.scores.__getitem__)
        picked += chosen.width is not None or chosen.trend
        among, to_labelled = sim[np.ix_(labelled, labelled)], sim[np.ix_(queries, labelled)]
        slope = trend_slope(among, values[labelled], size[labelled], chosen.k, chosen.temperature, chosen.width) if chosen.trend else None
        between = (size[queries], size[labelled])
        served = knn_regress(to_labelled, values[labelled], chosen.k, chosen.temperature, between, chosen.width, slope)
        unsized = knn_regress(to_labelled, values[labelled], plain.k, plain.temperature)
        gains.append(spearmanr(served, values[queries]).statistic - spearmanr(unsized, values[queries]).statistic)
    assert picked >= 8 and np.mean(gains) > 0.05


def test_the_trend_slope_is_the_within_task_slope_shrunk_by_its_ridge() -> None:
    """Tasks whose values are their own level plus one slope times the update size, and a similarity that is 1 within
    a task and 0 across: each adapter's leave-one-out neighbours are its task's others, so its residual is the slope
    times its size's gap from theirs, and the fit gives the slope shrunk by 1 / (1 + TREND_RIDGE) exactly. A query
    served with it gets its task's level plus the shrunk slope's share of its own gap."""
    rng = np.random.default_rng(0)
    group = np.repeat(np.arange(5), 6)
    size = rng.normal(size=len(group))
    level = rng.uniform(0, 1, 5)
    values = level[group] + 0.3 * size
    sim = (group[:, None] == group[None, :]).astype(float)
    slope = trend_slope(sim, values, size, k=5)
    assert slope.tolist() == pytest.approx([0.3 / (1 + TREND_RIDGE)], rel=1e-9)
    assert trend_slope(sim, values, np.full(len(group), 2.0), k=5).tolist() == [0.0]  # no gap in size: no trend
    query = np.array([[1.0] * 6 + [0.0] * 24])  # task 0's adapters as neighbours
    served = knn_regress(query, values, 6, sizes=(np.array([1.5]), size), slope=slope)[0]
    expected = np.mean(values[:6]) + slope[0] * (1.5 - np.mean(size[:6]))
    assert served == pytest.approx(expected, rel=1e-9)


def test_without_sizes_or_their_spread_no_knn_weighs_by_size() -> None:
    plain = KnnPredictor(SearchScore("module"), 10, 0.01)
    values = np.array([0.1, 0.5, np.nan, 0.9])
    assert sized_knns(plain, values, None) == [] and sized_knns(plain, values, np.full(4, 2.0)) == []
    assert sized_knns(plain, values, np.array([1.0, 2.0, np.inf, 3.0])) == sized_knns(plain, values, np.array([1.0, 2.0, 7.0, 3.0]))
    sized = sized_knns(plain, values, np.array([1.0, -np.inf, 5.0, 3.0]))
    assert sized == [] and all(k.width is not None and k.temperature == 0.01 for k in sized_knns(plain, values, np.arange(4.0)))


@given(
    st.lists(st.integers(-1000, 1000).map(lambda i: i / 1000), min_size=2, max_size=30, unique=True),
    st.lists(st.floats(-5, 5, allow_nan=False), min_size=30, max_size=30),
    st.sampled_from((None, 0.01, 0.1)),
)
def test_a_size_width_only_reweighs_by_the_size_gap(sims: list[float], gaps: list[float], temperature: float | None) -> None:
    """A width far beyond every gap weighs as no width does; neighbours of the query's size keep their weights'
    ratios; a neighbour further in size loses weight against one as similar and nearer in size."""
    top, gap = np.array(sims), np.array(gaps[: len(sims)])
    plain = knn_weights(top, temperature)
    assert np.allclose(knn_weights(top, temperature, gap, 1e9), plain, rtol=1e-9, atol=0)
    sized = knn_weights(top, temperature, gap, 1.0)
    same = np.flatnonzero(gap == 0)
    if len(same) >= 2:
        assert np.isclose(sized[same[0]] / sized[same[1]], plain[same[0]] / plain[same[1]])
    assert np.allclose(sized / plain * np.exp(gap**2 / 2) / (sized / plain * np.exp(gap**2 / 2))[0], 1.0)


@given(
    st.lists(st.integers(-1000, 1000).map(lambda i: i / 1000), min_size=2, max_size=30, unique=True),
    st.lists(st.floats(0, 1, allow_nan=False), min_size=30, max_size=30),
    st.integers(1, 30),
)
def test_a_knn_mean_runs_from_its_nearest_value_to_its_neighbours_mean_as_the_temperature_rises(
    sims: list[float], values: list[float], k: int
) -> None:
    row = np.array([sims])
    v = np.array(values[: len(sims)])
    top = np.argsort(-row[0])[: min(k, len(sims))]
    assert abs(knn_regress(row, v, k, temperature=1e-12)[0] - v[top[0]]) < 1e-9
    assert abs(knn_regress(row, v, k, temperature=1e12)[0] - v[top].mean()) < 1e-9
    assert np.allclose(knn_weights(row[0, top], 0.05).sum(), 1.0) and (np.diff(knn_weights(row[0, top], 0.05)) <= 0).all()


@given(st.sampled_from(("dw", "module", "input_gram", "module+w2t@0.3", "input_gram+w2t@0.3", "w2t")))
def test_knn_similarities_start_with_the_search_score(name: str) -> None:
    search = SearchScore.parse(name)
    similarities = knn_similarities(search)
    assert similarities[0] == search and set(EXACT) <= set(similarities) and len(set(similarities)) == len(similarities)


def test_knn_candidates_start_from_a_one_stage_similarity() -> None:
    """A chosen one-stage search is the kNN's first similarity; where a two-stage search is chosen (its stages order
    and do not weigh), the kNN starts from its second stage, the one-stage score the choice found best."""
    assert knn_similarity(SearchScore("module", 0.3)) == SearchScore("module", 0.3)
    assert knn_similarity(SearchScore("module", 0.8, 0.2, 10)) == SearchScore("module", 0.2)
    assert set(mix_candidates()) == {c for c in search_candidates() if c.second_stage is None}


@given(st.sampled_from(mix_candidates()))
def test_each_two_stage_search_is_a_one_stage_score_under_a_heavier_mix(base: SearchScore) -> None:
    staged = staged_over(base)
    assert all(s.second_stage == base and base.w2t_weight < s.w2t_weight < 1 and s.exact == base.exact for s in staged)
    assert len(staged) == len(set(staged)) == (0 if base.w2t_weight == 1 else len(RERANK_TOPS) * round(9 - 10 * base.w2t_weight))
    assert set(staged) <= set(search_candidates())


def test_a_second_stage_is_the_best_one_stage_score_and_the_first_adds_to_it() -> None:
    """The exact score knows each adapter's near twin (the first hit), W2T the task beyond it (the depth): a heavier
    mix finds more of the task, the exact score's best mix orders the first hits; so a two-stage search is chosen,
    over the one-stage score with the best estimate, and only because it is better still."""
    rng = np.random.default_rng(3)
    n_tasks, per = 8, 12
    tasks = [f"t{i}" for i in range(n_tasks) for _ in range(per)]
    same = np.array([[float(a == b) for b in tasks] for a in tasks])
    twin = np.zeros_like(same)
    for i in range(0, len(tasks), 2):  # pairs of near twins within each task
        twin[i, i + 1] = twin[i + 1, i] = 1.0
    noise = rng.normal(size=same.shape)
    exact = dict.fromkeys(EXACT_SCORES, 0.6 * twin + 0.15 * (noise + noise.T))
    centers = rng.normal(size=(n_tasks, 8))
    folds = []
    for part in np.array_split(rng.permutation(len(tasks)), 4):
        z = np.repeat(centers, per, axis=0) + 0.9 * rng.normal(size=(len(tasks), 8))
        z /= np.linalg.norm(z, axis=1, keepdims=True)
        folds.append(Fold(sorted(part.tolist()), sorted(set(range(len(tasks))) - set(part.tolist())), z))
    chosen = choose_search(exact, tasks, folds)
    second = chosen.chosen.second_stage
    assert second is not None and "best expected" in chosen.reason
    one_stage = {c: v for c, v in chosen.scores.items() if c.second_stage is None}
    assert second == max(one_stage, key=lambda c: one_stage[c]) and chosen.scores[chosen.chosen] > one_stage[second]


def test_the_guard_weighs_the_one_stage_choice_alone() -> None:
    """Whether choosing by the estimate pays over dW cosine is asked of the one-stage choice, replayed on halves; a
    two-stage search is only ever added over a one-stage pick the guard let through. On zoos where W2T helps a little,
    the search kept is dW cosine exactly where the one-stage replay says choosing a mix does not pay (on SURE of the
    halves)."""
    outcomes = set()
    for seed in range(12, 18):  # zoos where replaying both steps as one pick chooses otherwise
        exact, tasks, folds = _zoo(8, 5, w2t_noise=2.0, seed=seed)
        flat, w2t = held_out_w2t(folds, set(range(len(tasks))))
        own = self_excluded(flat, len(tasks))
        per = {}
        for c in mix_candidates():
            got = retrieval_per_query(c.ranking(exact[c.exact][flat], w2t, own), [tasks[q] for q in flat], tasks, list(flat))
            per[c] = got["mrr"] + got["ndcg@10"]
        mixes = [c for c in mix_candidates() if c.w2t_weight]  # the exact scores rank alike here: dW is the unmixed pick
        base, _ = best_expected(mixes, DW, lambda c, items, per=per: float(per[c][items].mean()), len(flat), sure=SURE)
        chosen = choose_search(exact, tasks, folds).chosen
        assert (chosen == DW) == (base == DW)
        assert chosen in (base, *staged_over(base)) and (chosen.second_stage or chosen) == base
        outcomes.add(chosen == DW)
    assert outcomes == {True, False}  # both sides of the guard were tried


def test_search_prefers_the_whole_update_unless_another_exact_score_is_expected_to_be_better() -> None:
    exact, tasks, folds = _zoo(6, 12, w2t_noise=20.0, seed=2)
    tied = {"dw": exact["dw"], "module": exact["dw"].copy(), "input_gram": exact["dw"].copy()}  # the same ranking: no gain, dW stays
    chosen = choose_search(tied, tasks, folds)
    assert chosen.chosen == DW and "stays" in chosen.reason
    same = np.array([[float(a == b) for b in tasks] for a in tasks])
    better = {"dw": exact["dw"], "module": 0.5 * same + 0.5 * exact["dw"], "input_gram": exact["dw"]}  # module cosine sees the task
    chosen = choose_search(better, tasks, folds)
    module = SearchScore("module")
    assert chosen.chosen == module and chosen.scores[module] > chosen.scores[DW] and "best expected" in chosen.reason
    gram = {"dw": exact["dw"], "module": exact["dw"], "input_gram": 0.5 * same + 0.5 * exact["dw"]}  # the input Gram sees it
    chosen = choose_search(gram, tasks, folds)
    input_gram = SearchScore("input_gram")
    assert chosen.chosen == input_gram and chosen.scores[input_gram] > chosen.scores[DW] and "best expected" in chosen.reason


def test_the_centred_input_gram_is_a_training_free_candidate_where_its_reference_was_fitted() -> None:
    """Where the exact scores hold the centred input Gram (ExactScores fitted its reference), the first step weighs it
    with the other training-free scores, and its mixes and kNNs are candidates; where they do not, nothing names it."""
    exact, tasks, folds = _zoo(6, 12, w2t_noise=20.0, seed=2)
    same = np.array([[float(a == b) for b in tasks] for a in tasks])
    centred = {**exact, "centred_gram": 0.5 * same + 0.5 * exact["dw"]}  # centring brings out the task
    chosen = choose_search(centred, tasks, folds)
    assert chosen.chosen == SearchScore("centred_gram") and "best expected" in chosen.reason
    assert SearchScore("centred_gram", 0.5) in chosen.scores
    assert SearchScore.parse("centred_gram+w2t@0.3") == SearchScore("centred_gram", 0.3)
    assert scores_for(centred, "task")[: len(EXACT_SCORES) + 1] == (*EXACT_SCORES, "centred_gram")
    plain = choose_search(exact, tasks, folds)
    assert not any("centred_gram" in s.name for s in plain.scores) and "centred_gram" not in scores_for(exact, "task")
    both = {**centred, "centred_gram": exact["dw"], "module_centred": 0.5 * same + 0.5 * exact["dw"]}  # the mean sees it
    chosen = choose_search(both, tasks, folds)
    assert chosen.chosen == SearchScore("module_centred") and "best expected" in chosen.reason
    assert SearchScore.parse("module_centred+w2t@0.3") == SearchScore("module_centred", 0.3)
    assert scores_for(both, "task")[: len(EXACT_SCORES) + 2] == (*EXACT_SCORES, "centred_gram", "module_centred")


def test_a_learned_mix_must_beat_the_best_training_free_score_not_only_dw() -> None:
    """Module cosine sees the task and W2T is noise: among the hundreds of mixes some estimate above module cosine by
    luck, and judged against dW alone (which module cosine beats) such a pick passed. Judged against the best
    training-free score, it stays module cosine on nearly every zoo."""
    weighs_w2t = 0
    for seed in range(20):
        exact, tasks, folds = _zoo(6, 8, w2t_noise=20.0, seed=seed)
        same = np.array([[float(a == b) for b in tasks] for a in tasks])
        noise = np.random.default_rng(seed + 100).normal(size=same.shape)
        scores = {"dw": exact["dw"], "module": 0.15 * same + exact["dw"] + 0.3 * (noise + noise.T), "input_gram": exact["dw"]}
        chosen = choose_search(scores, tasks, folds)
        first = chosen.chosen.second_stage or chosen.chosen  # the one-stage pick (a heavier mix may find what it orders)
        weighs_w2t += first.w2t_weight > 0
        assert "the first step" in chosen.reason
    assert weighs_w2t <= 2  # judged against dW cosine alone: 7 of the 20


def test_w2t_is_mixed_into_either_exact_score() -> None:
    exact, tasks, folds = _zoo(6, 12, w2t_noise=0.6)  # W2T helps, but is not enough alone
    same = np.array([[float(a == b) for b in tasks] for a in tasks])
    rng = np.random.default_rng(7)
    noise = rng.normal(size=exact["dw"].shape)
    scores = {"dw": exact["dw"] + (noise + noise.T), "module": 0.3 * same + exact["dw"], "input_gram": exact["dw"] + (noise + noise.T)}
    chosen = choose_search(scores, tasks, folds)
    assert chosen.chosen.exact == "module" and chosen.scores[chosen.chosen] > chosen.scores[DW]


def test_few_shot_readouts_of_a_separable_embedding() -> None:
    rng = np.random.default_rng(2)
    labels = [f"c{i % 3}" for i in range(30)]
    centers = rng.normal(size=(3, 6)) * 3
    z = np.stack([centers[int(label[1])] for label in labels]) + 0.1 * rng.normal(size=(30, 6))
    folds = [Fold(list(range(i, 30, 5)), [r for r in range(30) if (r - i) % 5], z) for i in range(5)]
    classes = sorted(set(labels))
    out = readout_predictions(labels, classes, folds)
    for readout in (PROTOTYPE, LOGREG):
        assert {r: labels[r] for r in range(30)} == {r: classes[int(p.argmax())] for r, p in out[readout].items()}
        assert all(np.isclose(p.sum(), 1.0) for p in out[readout].values())
    assert prototype_predictions(z, labels, list(range(10)), list(range(10, 30))) == labels[10:]
    exact = dict.fromkeys(EXACT_SCORES, np.eye(30))  # exact scores that know nothing
    choice, hits, _ = choose_attribute(exact, DW, labels, classes, out, folds)
    assert choice.chosen in (PROTOTYPE, LOGREG) and hits[choice.chosen].mean() == 1.0


def test_a_knn_mixed_with_w2t_is_calibrated_out_of_fold() -> None:
    """Its similarity was shaped by the labelled adapters' own labels (W2T trained on them), so its leave-one-out
    votes among them are surer than a query's: it is calibrated on the held-out items only, as a learned one is."""
    exact, tasks, folds = _zoo(6, 12, w2t_noise=0.3)
    classes = sorted(set(tasks))
    held_out = folds[:2]  # half of the adapters are held out somewhere
    choice, _, calibration = choose_attribute(exact, SearchScore("dw", 0.5), tasks, classes, {}, held_out)
    assert isinstance(choice.chosen, KnnPredictor) and choice.chosen.similarity.w2t_weight > 0  # W2T separates the tasks
    assert calibration.n == sum(len(f.val) for f in held_out) < len(tasks)
    choice, _, calibration = choose_attribute(exact, DW, tasks, classes, {}, held_out)  # training-free similarities only
    assert calibration.n == len(tasks)  # leave-one-out among every labelled adapter


def _clusters(n_classes: int, per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centers = np.random.default_rng(99).normal(size=(n_classes, 12))
    y = np.repeat(np.arange(n_classes), per_class)
    x = centers[y] + rng.normal(size=(len(y), 12))
    return x / np.linalg.norm(x, axis=1, keepdims=True), y


def test_a_knn_by_a_channel_metric_says_as_much_as_its_served_vote_is_worth() -> None:
    """Three labelled adapters per task, each fold holding a third out: a fold's vote among its training part sees
    two of a task where the served vote sees three. Calibrated on those votes, the kNN said 15 points less than it was
    right on queries (ECE 0.15); calibrated on the held-out adapters' votes among every other labelled adapter, by
    their fold's similarity (with the level one label further), it is within 7 points (ECE 0.10)."""
    n_classes, gaps, eces = 12, [], []
    for seed in range(12):
        x, y = _clusters(n_classes, 3, seed)
        q, qy = _clusters(n_classes, 40, 100 + seed)
        rng = np.random.default_rng(seed)
        noise = rng.normal(size=(len(y), len(y)))
        exact = {**dict.fromkeys(EXACT_SCORES, noise + noise.T), fitted_score("task"): x @ x.T}  # only the metric knows the tasks
        z = np.zeros((len(y), 1))
        parts = np.array_split(rng.permutation(len(y)), 3)
        folds = [Fold(sorted(p.tolist()), sorted(set(range(len(y))) - set(p.tolist())), z) for p in parts]
        labels = [f"t{c:02d}" for c in y]
        choice, _, calibration = choose_attribute(exact, DW, labels, sorted(set(labels)), {}, folds, "task")
        assert isinstance(choice.chosen, KnnPredictor) and choice.chosen.similarity.fitted == "task"
        p = calibration.apply(knn_vote_shares(q @ x.T, y, n_classes, choice.chosen.k))
        right = p.argmax(axis=1) == qy
        gaps.append(p.max(axis=1).mean() - right.mean())
        eces.append(expected_calibration_error(p.max(axis=1), right))
    assert abs(np.mean(gaps)) < 0.1 and np.mean(eces) < 0.12


def test_a_query_held_out_by_several_members_is_scored_by_their_mean_cosine() -> None:
    rng = np.random.default_rng(3)
    zs = [rng.normal(size=(6, 4)) for _ in range(3)]
    zs = [z / np.linalg.norm(z, axis=1, keepdims=True) for z in zs]
    folds = [Fold([0, 1, 2], [3, 4, 5], zs[0]), Fold([2, 3], [0, 1, 4, 5], zs[1]), Fold([4, 5, 0], [1, 2, 3], zs[2])]
    rows, w2t = held_out_w2t(folds, {0, 2, 3, 4})  # rows 1 and 5 have no task
    assert rows == [0, 2, 3, 4]  # in the order the folds first hold them out
    assert np.allclose(w2t[0], (zs[0][0] @ zs[0].T + zs[2][0] @ zs[2].T) / 2)
    assert np.allclose(w2t[1], (zs[0][2] @ zs[0].T + zs[1][2] @ zs[1].T) / 2)
    assert np.allclose(w2t[2], zs[1][3] @ zs[1].T) and np.allclose(w2t[3], zs[2][4] @ zs[2].T)
    shares = readout_predictions(["a", "b", "a", "b", "a", "b"], ["a", "b"], folds)
    for readout in (PROTOTYPE, LOGREG):  # a readout's shares for a row held out twice: the two members' mean
        alone = readout_predictions(["a", "b", "a", "b", "a", "b"], ["a", "b"], folds[:1])[readout][0]
        last = readout_predictions(["a", "b", "a", "b", "a", "b"], ["a", "b"], folds[2:])[readout][0]
        assert np.allclose(shares[readout][0], (alone + last) / 2)
