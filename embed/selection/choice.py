"""Methods chosen from the data, out of fold: the search score, and each attribute's and metric's predictor.

The rule (DESIGN.md): the candidate with the best expected quality, guarded against the winner's curse. Every
candidate is scored on the labelled adapters, each by the W2T members that never trained on it (one by default;
where several did, their mean cosine or mean prediction), against the labelled adapters. The candidate with the best estimate
is chosen unless choosing that way does not pay out of sample: the pick is replayed on random halves of the
held-out adapters and scored on the other halves, and unless its mean gain there over the training-free
reference is positive, the reference stays. With few
labels (or many candidates of equal worth) the best estimate is mostly noise and loses on the other halves;
with many, the best estimate wins without having to be "clearly" better.

- search: embed/selection/search_choice.py;
- an attribute: a similarity-weighted kNN among the labelled adapters, its similarity (the search score, or
  an exact score) and k (10, 5, 3, 1: few labels per class want few neighbours) those that classify the
  held-out adapters best, against the W2T heads, few-shot readouts of the W2T embedding (nearest class mean,
  logistic regression on the frozen embedding) and the kNNs by the attribute's channel metric, by accuracy against
  that kNN;
- a metric: the same kNN family (the metric's channel metric among its similarities), each also weighing its
  neighbours by a softmax at each of KNN_TEMPERATURES, and the best training-free one weighing them by update size or
  following the trend, chosen by Spearman against a reference kNN (metric_reference: the search's training-free
  score, 10 neighbours, following the trend with size); then the heads, the kNN in the W2T embedding and the kNNs by
  the channel metric, by Spearman against the kNN chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

import numpy as np

from embed.selection.calibration import Calibration, class_prior, knn_calibration, leave_one_out_shares, with_earned_sure
from embed.selection.calibration import fit as fit_calibration
from embed.selection.metrics import KNN_K, columns, knn_regress, knn_vote_shares, trend_slope
from zoo.domain.centred_gram import REFERENCED
from zoo.domain.exact_scores import EXACT_SCORES
from zoo.domain.methods import (
    LOGREG,
    PROTOTYPE,
    KnnPredictor,
    LearnedPredictor,
    Predictor,
    SearchScore,
    fitted_score,
    fused_score,
)

#: neighbours tried by the kNN predictors, in order of preference on a tie
KNN_KS = (KNN_K, 5, 3, 1)
#: softmax temperatures a metric's kNN candidates weigh their neighbours at (beside max(s, 0)): on digits-vit-seeded,
#: input-Gram 10-NN weights by max(s, 0) are nearly equal, and a temperature chosen on the labelled adapters took its
#: performance Spearman from 0.636 to 0.709 (docs/history/results-2026.md, "Performance Spearman: the kNN's weights")
KNN_TEMPERATURES = (0.003, 0.01, 0.03, 0.1)
#: neighbours and widths (in standard deviations of the labelled adapters' update sizes) of the kNN candidates that also
#: weigh a metric's neighbours by how alike their update's size is (KnnPredictor.width), by the best training-free kNN's
#: similarity and temperature: on digits-vit-seeded the log of an update's energy ranks held-out accuracy within a task at
#: Spearman +0.25 (the run's steps +0.35), and with them the default's performance Spearman rose from 0.753 to 0.790 on
#: 10 splits (docs/history/results-2026.md, "Performance: neighbours of a like size")
SIZED_KS = (30, KNN_K)
SIZE_WIDTHS = (0.5, 1.0, 2.0, 4.0)
#: the width (in the same standard deviations) the reference kNN of a metric weighs its neighbours' sizes at
#: (metric_reference): with it and the trend over the profile, the 10-NN by the same score ranked held-out accuracy about
#: +0.03 better on both real-seeds recipes (docs/history/results-2026.md, "Performance: the trend over the update's
#: profile")
REFERENCE_WIDTH = 1.0
#: temperature of the nearest-class-mean readout's softmax over cosines
PROTOTYPE_TEMPERATURE = 0.1
#: random halves of the held-out adapters the choice is replayed on, to estimate what choosing by the best estimate gains
HALVES = 200
#: fewer held-out adapters than this tell nothing: the reference stays
MIN_ITEMS = 5


@dataclass(frozen=True)
class Fold:
    """One member's out-of-fold view: rows it never trained on (`val`) and rows it did (`train`), as
    positions in the labelled set, and its W2T embeddings of that set."""

    val: list[int]
    train: list[int]
    z: np.ndarray


#: a chosen method: a search score or a predictor (zoo.domain.methods)
M = TypeVar("M", SearchScore, Predictor)


@dataclass
class Choice(Generic[M]):
    """What was chosen, with the out-of-fold scores of every candidate and the reason."""

    chosen: M
    scores: dict[M, float] = field(default_factory=dict)
    reason: str = ""

    def as_dict(self) -> dict[str, object]:
        """As checkpoints and JSON output record it: methods by name."""
        scores = {k.name: round(v, 4) for k, v in self.scores.items()}
        return {"chosen": self.chosen.name, "scores": scores, "reason": self.reason}


def knn_similarities(similarity: SearchScore, exact: Iterable[str] = EXACT_SCORES) -> list[SearchScore]:
    """The similarities a kNN predictor may use: `similarity` (a one-stage score: knn_similarity) first, then the
    exact scores `exact` (the training-free ones, and the target's own channel metric where it has one)."""
    return [similarity, *(s for s in map(SearchScore, exact) if s != similarity)]


def free_scores(exact: Iterable[str]) -> tuple[str, ...]:
    """The training-free exact scores: EXACT_SCORES, and those of the centred input Gram where `exact` holds them
    (its reference was fitted: zoo/domain/centred_gram.py REFERENCED)."""
    return (*EXACT_SCORES, *(s for s in REFERENCED if s in exact))


def scores_for(exact: dict[str, np.ndarray], purpose: str) -> tuple[str, ...]:
    """The exact scores a purpose ("search" or a target) weighs: the training-free ones (free_scores), then its own
    channel metric and that metric fused with dW, where `exact` holds their out-of-fold similarity
    (embed/selection/fitted.py)."""
    return (*free_scores(exact), *(s for s in (fitted_score(purpose), fused_score(purpose)) if s in exact))


def knn_similarity(search: SearchScore) -> SearchScore:
    """The similarity the kNN candidates start from: the chosen search score, or where it has two stages (which
    order and do not weigh) its second: the one-stage score the choice found best, or the fusion with dW that
    re-orders a metric's top (choose_search)."""
    return search.second_stage or search


K = TypeVar("K")


def best_expected(
    candidates: list[K],
    reference: K,
    score: Callable[[K, np.ndarray], float],
    n: int,
    pick: Callable[[np.ndarray], K] | None = None,
    sure: float = 0.0,
) -> tuple[K, float]:
    """The candidate with the best `score(candidate, items)` over all n held-out items (ties: the reference, then
    the first), or the reference unless picking that way pays: replayed on HALVES random halves of the items,
    each pick's score on the other half minus the reference's is averaged, and must be positive (with `sure`, the
    pick must also gain on at least that share of the halves). Returns the choice and that mean out-of-sample gain.
    `pick(items)`, where given, is the choice made from those items instead of the best score among them."""
    order = [reference, *(c for c in candidates if c != reference)]

    def best(items: np.ndarray) -> K:
        scores = [score(c, items) for c in order]
        return order[int(np.argmax(scores))]

    pick = pick or best

    rng = np.random.default_rng(0)
    gains = []
    for _ in range(HALVES):
        perm = rng.permutation(n)
        held_in, held_out = perm[: n // 2], perm[n // 2 :]
        gains.append(score(pick(held_in), held_out) - score(reference, held_out))
    gain = float(np.mean(gains))
    pays = gain > 0 and float(np.mean(np.array(gains) > 0)) >= sure
    return (pick(np.arange(n)) if pays else reference), gain


def why_chosen(
    chosen: SearchScore | Predictor, reference: SearchScore | Predictor, gain: float, n: int, measure: str, kind: str = "training-free"
) -> str:
    """Why `chosen` was chosen over `reference` (`kind`: what the reference is), or why the reference stays."""
    if chosen == reference:
        return (
            f"{reference.name}: choosing by the best estimate on half of {n} held-out adapters gained {gain:+.3f} "
            f"({measure}) on the other half, so the {kind} {reference.name} stays"
        )
    return (
        f"{chosen.name} has the best expected {measure} on {n} held-out adapters (choosing so on half of them gained "
        f"{gain:+.3f} over {reference.name} on the other half)"
    )


def mean_per_row(values: Iterable[tuple[int, np.ndarray]]) -> dict[int, np.ndarray]:
    """Each row's mean of its (row, value) pairs, rows in the order they first come: what the members that held a
    row out say of it, as one."""
    by_row: dict[int, list[np.ndarray]] = {}
    for r, v in values:
        by_row.setdefault(r, []).append(v)
    return {r: np.mean(v, axis=0) for r, v in by_row.items()}


def search_similarity(exact: dict[str, np.ndarray], score: SearchScore, z: np.ndarray, rows: list[int], cols: list[int]) -> np.ndarray:
    """A search score's similarity (its first stage) between labelled adapters `rows` and `cols` (W2T cosine from
    embeddings z)."""
    return score.similarity(exact[score.exact][np.ix_(rows, cols)], z[rows] @ z[cols].T)


def choose_attribute(
    exact: dict[str, np.ndarray],
    search: SearchScore,
    labels: list[str],
    classes: list[str],
    learned: dict[LearnedPredictor, dict[int, np.ndarray]],
    folds: list[Fold],
    target: str = "",
) -> tuple[Choice[Predictor], dict[Predictor, np.ndarray], Calibration]:
    """A kNN among the labelled adapters (the best of knn_similarities(search) × KNN_KS by no channel metric) or,
    guarded against it, a kNN by the `target`'s own channel metric (where `exact` holds it) or a learned predictor
    (`learned`: its out-of-fold class shares over `classes` by row: the W2T heads, few-shot readouts of the
    embedding), for one attribute (labels per labelled adapter, "" unknown). Returns the choice, every candidate's
    per-item hits, and the chosen predictor's calibration: fit on its out-of-fold shares, or for a kNN by a
    training-free similarity on the leave-one-out votes among all the labelled adapters (embed.selection.calibration
    knn_calibration: more votes, none of them shaped by its own label). A kNN by a similarity mixed with W2T, or by a
    channel metric, is calibrated out of fold like a learned predictor: the labelled adapters shaped the served
    similarity, so their leave-one-out votes are surer than a query's."""
    index = np.array([classes.index(label) if label else -1 for label in labels], np.int64)
    similarities = knn_similarities(search, scores_for(exact, target))
    knns = [KnnPredictor(sim, k) for sim in similarities for k in KNN_KS]
    shares: dict[Predictor, list[np.ndarray]] = {**{k: [] for k in knns}, **{k: [] for k in learned}}
    truth: list[int] = []
    for f in folds:
        val = [r for r in f.val if labels[r] and all(r in p for p in learned.values())]
        train = [r for r in f.train if labels[r]]
        if not val or not train:
            continue
        for similarity in similarities:
            sim = search_similarity(exact, similarity, f.z, val, train)
            for k in KNN_KS:
                shares[KnnPredictor(similarity, k)].append(knn_vote_shares(sim, index[train], len(classes), k))
        for name, p in learned.items():
            shares[name].append(np.stack([p[r] for r in val]))
        truth += index[val].tolist()
    t = np.array(truth, np.int64)
    oof = {k: np.concatenate(v) if v else np.zeros((0, len(classes))) for k, v in shares.items()}
    per = {k: (v.argmax(axis=1) == t).astype(np.float64) for k, v in oof.items()}
    means = {k: float(v.mean()) if len(v) else 0.0 for k, v in per.items()}
    free, weighed = _knn_reference(knns, learned, lambda k: means[k])
    chosen: Predictor = free
    reason = f"the best kNN on {len(t)} held-out adapters, too few to weigh a learned predictor"
    if weighed and len(t) >= MIN_ITEMS:
        chosen, value = best_expected(weighed, free, lambda c, items: float(per[c][items].mean()), len(t))
        reason = why_chosen(chosen, free, value, len(t), "accuracy") + (" (the best kNN)" if chosen == free else "")
    prior = class_prior(index[index >= 0], len(classes))
    if isinstance(chosen, KnnPredictor) and chosen.similarity.w2t_weight == 0:  # by an exact score or a channel metric
        calibration = _knn_calibration(exact, chosen, index, len(classes), prior, folds)
    else:  # a learned predictor, or a kNN by a W2T mix: by its out-of-fold shares
        calibration = with_earned_sure(fit_calibration(oof[chosen], t, prior), oof[chosen], t)
    return Choice(chosen, means, reason), per, calibration


def _knn_calibration(
    exact: dict[str, np.ndarray], knn: KnnPredictor, index: np.ndarray, n_classes: int, prior: tuple[float, ...], folds: list[Fold]
) -> Calibration:
    """A kNN's calibration from leave-one-out votes among every labelled adapter (embed.selection.calibration
    knn_calibration), each voted on by all the others as a query is by all of them. By a training-free similarity
    every labelled adapter votes; by a channel metric (fitted to the labels) only those a fold held out, each by its
    fold's metric (`exact` holds it out of fold: fitted without that adapter's label), so that its vote is as unsure
    as a query's. Calibrated instead on the folds' own votes among their training part, a channel metric's kNN saw a
    sixth fewer labels than it is served with and said too little (docs/search.md)."""
    rows = np.flatnonzero(index >= 0)
    score = knn.similarity
    if score.fitted is None:  # no label shaped it
        sim, voters = exact[score.exact][np.ix_(rows, rows)], None
    else:
        at = {r: i for i, r in enumerate(rows.tolist())}
        held = [r for r in dict.fromkeys(r for f in folds for r in f.val) if r in at]  # rows whose metric row is out of fold
        sim = np.full((len(rows), len(rows)), np.nan)
        voters = np.array([at[r] for r in held], np.int64)
        if len(held):
            sim[voters] = exact[score.exact][np.ix_(held, rows.tolist())]
    truth = index[rows] if voters is None else index[rows][voters]
    calibration = knn_calibration(sim, index[rows], n_classes, knn.k, prior, rows=voters)
    return with_earned_sure(calibration, leave_one_out_shares(sim, index[rows], n_classes, knn.k, voters), truth)


def _knn_reference(
    knns: list[KnnPredictor], learned: Iterable[LearnedPredictor], estimate: Callable[[KnnPredictor], float]
) -> tuple[KnnPredictor, list[Predictor]]:
    """(the reference: the kNN of best estimate by a similarity fitted to no label's channel metric, ties to the
    first; what is weighed against it, guarded: the learned predictors and the kNNs by a channel metric, which the
    labels shaped as they shaped a head)."""
    free = max((k for k in knns if k.similarity.fitted is None), key=estimate)
    return free, [*learned, *(k for k in knns if k.similarity.fitted is not None)]


def prototype_shares(z: np.ndarray, labels: list[str], classes: list[str], train: list[int], rows: list[int]) -> np.ndarray:
    """Nearest class mean in the embedding, as class shares over `classes` (softmax of the cosines to the labelled
    `train` rows' class means at temperature PROTOTYPE_TEMPERATURE; a class with no labelled row gets 0)."""
    means = np.zeros((len(classes), z.shape[1]))
    for c, name in enumerate(classes):
        members = [r for r in train if labels[r] == name]
        if members:
            means[c] = z[members].mean(axis=0)
    present = (means != 0).any(axis=1)
    means /= np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-12)
    logits = (z[rows] @ means.T) / PROTOTYPE_TEMPERATURE
    logits[:, ~present] = -np.inf
    return softmax_rows(logits)


def softmax_rows(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax (-inf columns get 0)."""
    logits = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(axis=1, keepdims=True)


def prototype_predictions(z: np.ndarray, labels: list[str], train: list[int], rows: list[int]) -> list[str]:
    """Nearest class mean in the embedding: each row's class among the labelled `train` rows' classes."""
    classes = sorted({labels[r] for r in train if labels[r]})
    return [classes[i] for i in prototype_shares(z, labels, classes, train, rows).argmax(axis=1)]


def logistic_readout(z: np.ndarray, labels: list[str]) -> object | None:
    """Logistic regression on frozen embeddings of the labelled rows (None with fewer than two classes)."""
    from sklearn.linear_model import LogisticRegression  # imported here: every `zoo` command loads this module, few train

    known = [r for r, label in enumerate(labels) if label]
    if len({labels[r] for r in known}) < 2:
        return None
    return LogisticRegression(max_iter=2000, C=1.0).fit(z[known], [labels[r] for r in known])


def readout_predictions(labels: list[str], classes: list[str], folds: list[Fold]) -> dict[LearnedPredictor, dict[int, np.ndarray]]:
    """Out-of-fold class shares (over `classes`) of the few-shot readouts (prototype, logistic regression) of each
    member's embedding; a row held out by several members gets their mean."""
    held: dict[LearnedPredictor, list[tuple[int, np.ndarray]]] = {PROTOTYPE: [], LOGREG: []}
    for f in folds:
        train = [r for r in f.train if labels[r]]
        val = [r for r in f.val if labels[r]]
        if not val or len({labels[r] for r in train}) < 2:
            continue
        model = logistic_readout(f.z[train], [labels[r] for r in train])
        p = np.zeros((len(val), len(classes)))
        p[:, [classes.index(c) for c in model.classes_]] = model.predict_proba(f.z[val])  # type: ignore[attr-defined]
        held[PROTOTYPE] += zip(val, prototype_shares(f.z, labels, classes, train, val), strict=True)
        held[LOGREG] += zip(val, p, strict=True)
    return {readout: mean_per_row(pairs) for readout, pairs in held.items()}


def choose_metric(
    exact: dict[str, np.ndarray],
    search: SearchScore,
    values: np.ndarray,
    learned: dict[LearnedPredictor, dict[int, float]],
    folds: list[Fold],
    target: str = "",
    profiles: np.ndarray | None = None,
) -> tuple[Choice[Predictor], np.ndarray, np.ndarray]:
    """A kNN among the labelled adapters (as for attributes, and at each temperature of KNN_TEMPERATURES, by
    Spearman; given the labelled adapters' update `profiles` (zoo.domain.sizes.PROFILE), the best of them also at
    SIZED_KS neighbours weighed by their update's size: sized_knns, like k and T nothing the labels shaped; and
    following the trend of value with the profile: trend_knns, its slope fitted on each fold's training part) or,
    weighed against it as learned predictors are, the kNNs by the `target` metric's own channel metric (where `exact`
    holds it) or a learned predictor (`learned`: its out-of-fold predictions by row, e.g. the heads and a kNN in the W2T
    embedding), for one metric (values per labelled adapter, NaN unknown). Returns the choice, and the chosen
    predictor's out-of-fold predictions with the truth."""
    similarities = knn_similarities(search, scores_for(exact, target))
    knns = [KnnPredictor(sim, k, temp) for sim in similarities for k in KNN_KS for temp in (None, *KNN_TEMPERATURES)]
    preds: dict[Predictor, list[float]] = {**{k: [] for k in knns}, **{k: [] for k in learned}}
    held = _with_values(folds, values, learned)
    for f, val, train in held:
        for knn, v in _knn_estimates(exact, knns, values, f, val, train).items():
            preds[knn] += v
        for name, p in learned.items():
            preds[name] += [p[r] for r in val]
    t = np.concatenate([values[val] for _, val, _ in held]) if held else np.zeros(0)
    means = {k: _spearman(np.array(v), t) for k, v in preds.items()}
    best, weighed = _knn_reference(knns, learned, lambda k: float(np.nan_to_num(means[k], nan=-2.0)))
    reference = metric_reference(similarities[0], free_scores(exact), values, profiles)
    sized = list(dict.fromkeys([*sized_knns(best, values, profiles), *trend_knns(best, values, profiles), reference]))
    sized = [k for k in sized if k not in preds]
    for f, val, train in held:
        for knn, v in _knn_estimates(exact, sized, values, f, val, train, profiles).items():
            preds.setdefault(knn, []).extend(v)
    per = {k: np.array(v) for k, v in preds.items()}
    means.update({k: _spearman(per[k], t) for k in sized})

    def spearman(c: Predictor, items: np.ndarray) -> float:
        return _spearman(per[c][items], t[items])

    if len(t) < MIN_ITEMS:
        return Choice(reference, means, f"{reference.name}: {len(t)} held-out adapters are too few to choose by"), per[reference], t
    order: list[Predictor] = [reference, *(k for k in [*knns, *sized] if k != reference)]
    stacked = np.array([per[k] for k in order])

    def best_free(items: np.ndarray) -> Predictor:  # the best estimate among a hundred kNNs, ranked all at once
        return order[int(np.argmax(spearman_rows(stacked[:, items], t[items])))]

    free, gain = best_expected(order, reference, spearman, len(t), best_free)
    reason = why_chosen(free, reference, gain, len(t), "Spearman", "reference kNN")
    if not weighed:
        return Choice(free, means, reason), per[free], t
    chosen, value = best_expected(weighed, free, spearman, len(t))
    reason = f"{reason}; then {why_chosen(chosen, free, value, len(t), 'Spearman', 'kNN')}"
    return Choice(chosen, means, reason), per[chosen], t


def metric_reference(search: SearchScore, free: Iterable[str], values: np.ndarray, profiles: np.ndarray | None) -> KnnPredictor:
    """The kNN a metric's choice keeps unless choosing by the best estimate pays (best_expected): KNN_K neighbours by
    the search's training-free score (`search`'s exact score where it is one of `free`, else dW), weighed by how alike
    their update's size is at REFERENCE_WIDTH and following the trend of value with the update's profile, where the
    profiles allow (size_widths, trend_knns; the trend's slope, shrunk toward 0, stays near 0 where the profile says
    nothing). Among a hundred kNNs the best estimate on a few dozen labelled adapters is mostly noise: on
    docs-minilm-seeded it took 1 to 5 neighbours on 8 of 10 splits and ranked held-out accuracy no better than dW's
    10-NN (docs/history/results-2026.md, "Performance: the metric's kNN chosen against a reference")."""
    similarity = SearchScore(search.exact if search.exact in free else EXACT_SCORES[0])
    width = next(iter(size_widths(values, profiles, (REFERENCE_WIDTH,))), None)
    plain = KnnPredictor(similarity, KNN_K, None, width)
    return next(iter(trend_knns(plain, values, profiles)), plain)


def sized_knns(free: KnnPredictor, values: np.ndarray, profiles: np.ndarray | None) -> list[KnnPredictor]:
    """The training-free kNN `free` (its similarity and temperature) at SIZED_KS neighbours, also weighing them by their
    update's size at each of SIZE_WIDTHS (size_widths): a few candidates, each as free of the labels as k and T, beside
    the best kNN rather than beside every one (the best estimate among many flatters its pick)."""
    widths = size_widths(values, profiles, SIZE_WIDTHS)
    return [KnnPredictor(free.similarity, k, free.temperature, w) for k in SIZED_KS for w in widths]


def size_widths(values: np.ndarray, profiles: np.ndarray | None, factors: Iterable[float]) -> list[float]:
    """Each of `factors` times the spread (standard deviation) of the sizes (the profiles' first column) of the labelled
    adapters with a value, to 3 digits: the widths a kNN weighs its neighbours' sizes at. None without profiles, or
    where the sizes are not finite or do not spread."""
    if profiles is None:
        return []
    known = columns(profiles)[~np.isnan(values), 0]
    spread = float(np.std(known)) if len(known) > 1 and np.isfinite(known).all() else 0.0
    return [float(f"{w * spread:.3g}") for w in factors] if spread > 0 else []


def trend_knns(free: KnnPredictor, values: np.ndarray, profiles: np.ndarray | None) -> list[KnnPredictor]:
    """The training-free kNN `free` following the trend of value with the update's profile (KnnPredictor.trend): one
    candidate, beside the best kNN as sized_knns are. None without profiles, or where they are not finite."""
    if profiles is None or not np.isfinite(columns(profiles)[~np.isnan(values)]).all():
        return []
    return [replace(free, trend=True)]


def _with_values(
    folds: list[Fold], values: np.ndarray, learned: dict[LearnedPredictor, dict[int, float]]
) -> list[tuple[Fold, list[int], list[int]]]:
    """Each fold with its held-out rows that have a value and every learned predictor's estimate, and its training rows
    that have a value; folds short of either left out."""
    held = []
    for f in folds:
        val = [r for r in f.val if not np.isnan(values[r]) and all(r in p for p in learned.values())]
        train = [r for r in f.train if not np.isnan(values[r])]
        if val and train:
            held.append((f, val, train))
    return held


def _knn_estimates(
    exact: dict[str, np.ndarray],
    knns: list[KnnPredictor],
    values: np.ndarray,
    fold: Fold,
    val: list[int],
    train: list[int],
    profiles: np.ndarray | None = None,
) -> dict[KnnPredictor, list[float]]:
    """Each kNN's estimates of a fold's held-out rows `val` from its training rows `train` (one similarity matrix each)."""
    out: dict[KnnPredictor, list[float]] = {}
    between = None if profiles is None else (profiles[val], profiles[train])
    for similarity in dict.fromkeys(k.similarity for k in knns):
        sim = search_similarity(exact, similarity, fold.z, val, train)
        for knn in (k for k in knns if k.similarity == similarity):
            slope = knn_slope(exact, knn, fold.z, values, profiles, train) if knn.trend and profiles is not None else None
            out[knn] = knn_regress(sim, values[train], knn.k, knn.temperature, between, knn.width, slope).tolist()
    return out


def knn_slope(
    exact: dict[str, np.ndarray], knn: KnnPredictor, z: np.ndarray, values: np.ndarray, profiles: np.ndarray, rows: list[int]
) -> np.ndarray:
    """The slope a kNN that follows the trend (KnnPredictor.trend) is served with, fitted on the labelled adapters
    `rows` (their similarity from `exact` and the W2T embeddings `z`, their values and update profiles)."""
    among = search_similarity(exact, knn.similarity, z, rows, rows)
    return trend_slope(among, values[rows], profiles[rows], knn.k, knn.temperature, knn.width)


def spearman_rows(pred: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Each row of `pred`'s Spearman correlation with `truth`, as _spearman gives it (-1 where either is constant
    or undefined)."""
    from scipy.stats import rankdata

    rp, rt = rankdata(pred, axis=1), rankdata(truth)
    rp, rt = rp - rp.mean(axis=1, keepdims=True), rt - rt.mean()
    norm = np.sqrt((rp**2).sum(axis=1) * (rt**2).sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = (rp @ rt) / norm
    return np.nan_to_num(np.where(norm > 0, rho, -1.0), nan=-1.0)


def _spearman(pred: np.ndarray, truth: np.ndarray) -> float:
    from scipy.stats import spearmanr  # imported here: every `zoo` command loads this module, few train

    if len(truth) < 2:
        return float("nan")
    if np.ptp(pred) == 0 or np.ptp(truth) == 0:  # a constant ranks nothing
        return -1.0
    return float(np.nan_to_num(spearmanr(pred, truth).statistic, nan=-1.0))
