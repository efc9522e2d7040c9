"""Methods chosen out of fold (embed/choice.py): a learned method replaces a training-free one only when it
wins clearly; with few labels the exact scores stay."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from embed.choice import (
    KNN_KS,
    MIX_WEIGHTS,
    Fold,
    choose_attribute,
    choose_metric,
    choose_search,
    clearly_better,
    clearly_better_rank,
    gain_lower_bound,
    knn_similarities,
    prototype_predictions,
    readout_predictions,
)
from embed.metrics import KNN_K
from zoo.domain.methods import HEAD, LOGREG, NEIGHBOURS, PROTOTYPE, KnnPredictor, SearchScore
from zoo.domain.similarity import EXACT_SCORES

DW, W2T = SearchScore("dw"), SearchScore("dw", 1.0)
EXACT = [SearchScore(s) for s in EXACT_SCORES]


@given(st.sampled_from(EXACT_SCORES), st.sampled_from((0.0, *MIX_WEIGHTS)))
def test_every_search_candidate_has_its_own_name(exact: str, weight: float) -> None:
    """Candidates differ by name: W2T alone mixes in no exact score, so it is one candidate whatever `exact` says."""
    score = SearchScore(exact, weight)
    assert SearchScore.parse(score.name) == score and score.w2t_weight == weight
    assert score.exact == exact or (weight == 1 and score == W2T)


def test_clearly_better_needs_a_clear_and_large_enough_win() -> None:
    rng = np.random.default_rng(0)
    truth = rng.normal(size=200)
    close, far = truth + 0.5 * rng.normal(size=200), truth + 2.0 * rng.normal(size=200)
    assert clearly_better_rank(close, far, truth) and not clearly_better_rank(far, close, truth)
    assert not clearly_better_rank(close, close + 1e-3 * rng.normal(size=200), truth)  # a hair better is not clearly better
    assert not clearly_better_rank(close[:4], far[:4], truth[:4])  # too few to tell
    hits, misses = np.ones(60), np.r_[np.ones(30), np.zeros(30)]
    assert clearly_better(hits, misses) and not clearly_better(misses, hits)
    assert not clearly_better(np.r_[1.0, np.ones(3)], np.r_[0.0, np.ones(3)])  # too few


def _onehot(i: int, n: int) -> np.ndarray:
    return np.eye(n)[i]


def _zoo(n_tasks: int, per_task: int, w2t_noise: float, seed: int = 0) -> tuple[dict[str, np.ndarray], list[str], list[Fold]]:
    """Exact scores that carry the task weakly (a noisy cosine) and W2T embeddings that carry it with `w2t_noise`."""
    rng = np.random.default_rng(seed)
    tasks = [f"t{i}" for i in range(n_tasks) for _ in range(per_task)]
    centers = rng.normal(size=(n_tasks, 8))
    x = np.repeat(centers, per_task, axis=0) + 2.5 * rng.normal(size=(len(tasks), 8))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    exact = {"dw": x @ x.T, "module": x @ x.T * 0.9}
    folds = []
    perm = rng.permutation(len(tasks))
    for part in np.array_split(perm, 4):
        z = np.repeat(centers, per_task, axis=0) + w2t_noise * rng.normal(size=(len(tasks), 8))
        z /= np.linalg.norm(z, axis=1, keepdims=True)
        folds.append(Fold(sorted(part.tolist()), sorted(set(range(len(tasks))) - set(part.tolist())), z))
    return exact, tasks, folds


def test_search_keeps_the_exact_score_unless_w2t_clearly_retrieves_better() -> None:
    exact, tasks, folds = _zoo(6, 12, w2t_noise=0.05)  # W2T separates the tasks, the exact score barely
    chosen = choose_search(exact, tasks, folds)
    assert chosen.chosen not in EXACT and chosen.scores[chosen.chosen] > chosen.scores[DW]
    exact, tasks, folds = _zoo(6, 12, w2t_noise=20.0)  # W2T is noise
    chosen = choose_search(exact, tasks, folds)
    assert chosen.chosen == DW and "no W2T mix" in chosen.reason  # the better exact score (dw ≥ module here)
    exact, tasks, folds = _zoo(2, 2, w2t_noise=0.05)  # four labels: too few to tell
    assert choose_search(exact, tasks, folds).chosen in EXACT


def test_attribute_and_metric_predictors_default_to_the_knn() -> None:
    exact, tasks, folds = _zoo(4, 10, w2t_noise=0.05)
    knns = [KnnPredictor(s, k) for s in knn_similarities(DW) for k in KNN_KS]
    classes = sorted(set(tasks))
    good_heads = {r: _onehot(classes.index(t), len(classes)) for r, t in enumerate(tasks)}
    choice, hits, _ = choose_attribute(exact, DW, tasks, classes, {HEAD: good_heads}, folds, folds[0].z)
    best_knn = max(hits[k].mean() for k in knns)
    assert hits[HEAD].mean() == 1.0 and (choice.chosen == HEAD) == (best_knn < 0.85)
    wrong_heads = {r: _onehot(0, len(classes)) for r in range(len(tasks))}
    choice, hits, _ = choose_attribute(exact, DW, tasks, classes, {HEAD: wrong_heads}, folds, folds[0].z)
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
    exact = {"dw": x @ x.T, "module": x @ x.T}
    z = np.eye(len(labels))
    folds = [Fold(list(range(i, len(labels), 4)), [r for r in range(len(labels)) if (r - i) % 4], z) for i in range(4)]
    choice, hits, _ = choose_attribute(exact, DW, labels, sorted(set(labels)), {}, folds, z)
    assert isinstance(choice.chosen, KnnPredictor) and choice.chosen.k < KNN_K
    assert hits[choice.chosen].mean() > hits[KnnPredictor(DW, KNN_K)].mean()
    values = np.array([float(label[1:]) for label in labels])
    choice, _, _ = choose_metric(exact, DW, values, {}, folds)
    assert isinstance(choice.chosen, KnnPredictor) and choice.chosen.k < KNN_K


@given(st.sampled_from(("dw", "module", "module+w2t@0.3", "w2t")))
def test_knn_similarities_start_with_the_search_score(name: str) -> None:
    search = SearchScore.parse(name)
    similarities = knn_similarities(search)
    assert similarities[0] == search and set(EXACT) <= set(similarities) and len(set(similarities)) == len(similarities)


def test_search_prefers_the_whole_update_unless_module_cosine_is_better_by_more_than_its_error() -> None:
    exact, tasks, folds = _zoo(6, 12, w2t_noise=20.0)
    rng = np.random.default_rng(5)
    wobble = 0.02 * rng.normal(size=exact["dw"].shape)
    tied = {"dw": exact["dw"], "module": exact["dw"] + (wobble + wobble.T) / 2}  # the same ranking, give or take
    chosen = choose_search(tied, tasks, folds)
    assert chosen.chosen == DW and "no exact score beats it" in chosen.reason
    same = np.array([[float(a == b) for b in tasks] for a in tasks])
    better = {"dw": exact["dw"], "module": 0.5 * same + 0.5 * exact["dw"]}  # module cosine sees the task
    chosen = choose_search(better, tasks, folds)
    module = SearchScore("module")
    assert chosen.chosen == module and chosen.scores[module] > chosen.scores[DW] and "standard error" in chosen.reason


def test_w2t_is_mixed_only_into_the_exact_score_chosen() -> None:
    exact, tasks, folds = _zoo(6, 12, w2t_noise=0.05)
    rng = np.random.default_rng(7)
    noise = rng.normal(size=exact["dw"].shape)
    worse = {"dw": exact["dw"], "module": exact["dw"] + (noise + noise.T)}  # module cosine ranks worse than dw
    chosen = choose_search(worse, tasks, folds)
    mixes = [k for k in chosen.scores if 0 < k.w2t_weight < 1]
    assert mixes and all(k.exact == "dw" for k in mixes) and chosen.chosen.exact == "dw"
    assert chosen.chosen != DW  # W2T separates the tasks: a mix (or W2T alone) over dw wins


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
    exact = {"dw": np.eye(30), "module": np.eye(30)}  # an exact score that knows nothing
    choice, hits, _ = choose_attribute(exact, DW, labels, classes, out, folds, z)
    assert choice.chosen in (PROTOTYPE, LOGREG) and hits[choice.chosen].mean() == 1.0


def test_the_surest_gain_beats_a_larger_but_noisier_one() -> None:
    rng = np.random.default_rng(3)
    default = rng.uniform(size=60)
    steady = default + 0.05  # a small gain on every query
    noisy = default + 0.1 + rng.normal(scale=1.0, size=60)  # twice the mean gain, mostly noise
    assert (noisy - default).mean() > (steady - default).mean()
    assert gain_lower_bound(steady, default) > 0 > gain_lower_bound(noisy, default)
    assert clearly_better(steady, default) and not clearly_better(noisy, default)
    assert gain_lower_bound(steady[:4], default[:4]) == float("-inf")  # too few queries to tell


def test_no_w2t_mix_where_most_of_the_space_has_no_task() -> None:
    exact, tasks, folds = _zoo(6, 12, w2t_noise=0.05)  # W2T separates the tasks: a mix wins when the labelled are the space
    assert choose_search(exact, tasks, folds, space_size=len(tasks)).chosen not in EXACT
    scarce = choose_search(exact, tasks, folds, space_size=3 * len(tasks))  # two thirds of the space unlabelled
    assert scarce.chosen in EXACT and "no W2T mix competes" in scarce.reason
    assert all(k.w2t_weight == 0 for k in scarce.scores)
