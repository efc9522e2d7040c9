"""Methods chosen from the data, out of fold: the search score, and each attribute's and metric's predictor.

The rule (DESIGN.md): a learned method replaces a training-free one only where it wins out of fold.
Every choice is scored on the adapters a W2T ensemble member never trained on (its fold), pooled over
the members, against the labelled adapters:

- search: the exact scores (the whole update's dW cosine, the mean module cosine), then mixes of the chosen
  one with the W2T cosine, by each held-out adapter's MRR + nDCG@10 (relevance = same task). The exact score
  is the whole update's cosine unless module cosine retrieves better by more than the standard error of the
  per-query difference; a mix (or W2T alone) replaces it only if its per-query gain is clearly positive
  (paired bootstrap, one-sided 95 %), the mix with the highest lower bound of that gain. A replacement must
  also be behind on none of hit@1, MRR and nDCG@10 (means), so with few labels the training-free score stays;
- an attribute: a similarity-weighted kNN among the labelled adapters, its similarity (the search score,
  or either exact score) and k (10, 5, 3, 1: few labels per class want few neighbours) those that classify
  the held-out adapters best, unless the W2T heads or a few-shot readout of the W2T embedding (nearest class
  mean, logistic regression on the frozen embedding) classify them clearly better;
- a metric: the same kNN family (best Spearman), unless the heads or the kNN in the W2T embedding rank the
  held-out adapters clearly better (Spearman).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from embed.calibration import Calibration, class_prior, knn_calibration
from embed.calibration import fit as fit_calibration
from embed.metrics import KNN_K, knn_regress, knn_vote_shares, retrieval_per_query
from zoo.domain.methods import LOGREG, PROTOTYPE, KnnPredictor, LearnedPredictor, Predictor, SearchScore
from zoo.domain.similarity import EXACT_SCORES, hybrid_score

#: W2T weights of the mixes tried (1.0: the W2T cosine alone)
MIX_WEIGHTS = tuple(i / 10 for i in range(1, 11))
#: neighbours tried by the kNN predictors, in order of preference on a tie
KNN_KS = (KNN_K, 5, 3, 1)
#: retrieval measures a search score replacing another must not be behind on (out of fold, means)
SEARCH_KEYS = ("hit@1", "mrr", "ndcg@10")
#: W2T mixes compete only where at least this share of the space's adapters has a task: held-out retrieval is
#: measured among those, and a gallery mostly of unlabelled adapters ranks otherwise (more near-duplicates, none
#: of them trained on)
MIN_LABELLED_SHARE = 0.5
#: temperature of the nearest-class-mean readout's softmax over cosines
PROTOTYPE_TEMPERATURE = 0.1
#: bootstrap resamples and one-sided confidence of "clearly better"
RESAMPLES = 1000
CONFIDENCE = 0.95


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
        return {"chosen": self.chosen.name, "scores": {k.name: round(v, 4) for k, v in self.scores.items()}, "reason": self.reason}


def knn_similarities(search: SearchScore) -> list[SearchScore]:
    """The similarities a kNN predictor may use: the search score first, then the exact scores."""
    return [search, *(s for s in map(SearchScore, EXACT_SCORES) if s != search)]


def standard_error(diff: np.ndarray) -> float:
    """Standard error of the mean of per-item differences."""
    return float(np.std(diff, ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else float("inf")


def gain_lower_bound(candidate: np.ndarray, default: np.ndarray) -> float:
    """The one-sided 95 % lower bound of the candidate's mean per-item gain over the default (paired bootstrap,
    the same resamples for every candidate of one size); -inf with fewer than 5 items."""
    if len(candidate) < 5:
        return float("-inf")
    diff = np.asarray(candidate, np.float64) - np.asarray(default, np.float64)
    rng = np.random.default_rng(0)
    means = diff[rng.integers(0, len(diff), size=(RESAMPLES, len(diff)))].mean(axis=1)
    return float(np.quantile(means, 1 - CONFIDENCE))


def clearly_better(candidate: np.ndarray, default: np.ndarray) -> bool:
    """Whether the candidate's per-item scores beat the default's with one-sided 95 % confidence (paired
    bootstrap of the mean difference); too few items (< 5) never do."""
    gain = float(np.mean(np.asarray(candidate, np.float64) - np.asarray(default, np.float64)))
    return gain > 0 and gain_lower_bound(candidate, default) > 0  # the bound is -inf below 5 items


def choose_search(exact: dict[str, np.ndarray], tasks: list[str], folds: list[Fold], space_size: int | None = None) -> Choice[SearchScore]:
    """The search score, from the labelled adapters' out-of-fold retrieval: `exact` holds each exact score
    between the labelled adapters (n × n), `tasks` their tasks ("" unknown), `space_size` the number of adapters
    search ranks (default: n). The exact score is chosen first; W2T is mixed only into that one (a mix over the
    score not chosen would re-open a choice the data did not settle), and only where the adapters with a task
    are at least MIN_LABELLED_SHARE of the space."""
    queries = [[r for r in f.val if tasks[r]] for f in folds]
    flat = [r for rows in queries for r in rows]
    if len(flat) < 2:
        return Choice(SearchScore(), reason="fewer than 2 held-out adapters with a task: the whole update's dW cosine")
    per: dict[SearchScore, dict[str, np.ndarray]] = {}

    def score(name: SearchScore, sim: np.ndarray) -> None:
        per[name] = retrieval_per_query(sim, [tasks[q] for q in flat], tasks, list(flat))
        per[name]["quality"] = per[name]["mrr"] + per[name]["ndcg@10"]

    def behind_on(name: SearchScore, default: SearchScore) -> list[str]:
        return [k for k in SEARCH_KEYS if per[name][k].mean() < per[default][k].mean()]

    exact_scores = [SearchScore(s) for s in EXACT_SCORES]
    for exact_score in exact_scores:
        score(exact_score, exact[exact_score.exact][flat])
    base = exact_scores[0]  # the whole update's cosine, the training-free bar
    best = max(exact_scores, key=lambda k: per[k]["quality"].mean())  # ties: the first
    gain = per[best]["quality"] - per[base]["quality"]
    free = best if best != base and gain.mean() > standard_error(gain) and not behind_on(best, base) else base
    if free != base:
        why = f"{best.name} beats {base.name} by more than its standard error"
    else:
        why = f"{base.name}: no exact score beats it by more than its standard error and on every measure"
    with_task, size = sum(1 for t in tasks if t), space_size or len(tasks)
    if with_task < MIN_LABELLED_SHARE * size:
        reason = (
            f"{with_task} of {size} adapters have a task: retrieval among them does not stand for the space's, "
            f"so no W2T mix competes ({why})"
        )
        return Choice(free, {k: float(v["quality"].mean()) for k, v in per.items()}, reason)
    w2t = np.concatenate([f.z[q] @ f.z.T for f, q in zip(folds, queries, strict=True) if q])
    mixes = [SearchScore(free.exact, w) for w in MIX_WEIGHTS]
    for mix, weight in zip(mixes, MIX_WEIGHTS, strict=True):
        score(mix, hybrid_score(exact[free.exact][flat], w2t, weight))
    means = {k: float(v["quality"].mean()) for k, v in per.items()}
    learned = max(mixes, key=lambda k: means[k])
    n = len(flat)
    eligible = [k for k in mixes if not behind_on(k, free)]
    bound = {k: gain_lower_bound(per[k]["quality"], per[free]["quality"]) for k in eligible}
    if eligible:
        candidate = max(eligible, key=lambda k: bound[k])  # the surest gain, not the largest mean: fewer labels, smaller steps
        if clearly_better(per[candidate]["quality"], per[free]["quality"]):
            reason = (
                f"{candidate.name} retrieves clearly better than {free.name} on {n} held-out adapters (the surest gain: 95 % lower bound "
                f"{bound[candidate]:+.3f} of MRR + nDCG@10), and is behind on no measure ({why})"
            )
            return Choice(candidate, means, reason)
    behind = behind_on(learned, free)
    lag = f", and is behind on {', '.join(behind)}" if behind else ""
    reason = f"no W2T mix retrieves clearly better than {free.name} on {n} held-out adapters (best: {learned.name}{lag}; {why})"
    return Choice(free, means, reason)


def search_similarity(exact: dict[str, np.ndarray], score: SearchScore, z: np.ndarray, rows: list[int], cols: list[int]) -> np.ndarray:
    """A search score between labelled adapters `rows` and `cols` (W2T cosine from embeddings z)."""
    return hybrid_score(exact[score.exact][np.ix_(rows, cols)], z[rows] @ z[cols].T, score.w2t_weight)


def choose_attribute(
    exact: dict[str, np.ndarray],
    search: SearchScore,
    labels: list[str],
    classes: list[str],
    learned: dict[LearnedPredictor, dict[int, np.ndarray]],
    folds: list[Fold],
    z: np.ndarray,
) -> tuple[Choice[Predictor], dict[Predictor, np.ndarray], Calibration]:
    """A kNN among the labelled adapters (the best of knn_similarities(search) × KNN_KS) or a
    learned predictor (`learned`: its out-of-fold class shares over `classes` by row: the W2T heads, few-shot
    readouts of the embedding), for one attribute (labels per labelled adapter, "" unknown). Returns the choice,
    every candidate's per-item hits, and the chosen predictor's calibration: a learned one's fit on its
    out-of-fold shares, a kNN's on the leave-one-out votes among all the labelled adapters (embed.calibration
    knn_calibration; `z`: the served embedding of the labelled adapters, for similarities mixed with W2T)."""
    index = np.array([classes.index(label) if label else -1 for label in labels], np.int64)
    knns = [KnnPredictor(sim, k) for sim in knn_similarities(search) for k in KNN_KS]
    shares: dict[Predictor, list[np.ndarray]] = {**{k: [] for k in knns}, **{k: [] for k in learned}}
    truth: list[int] = []
    for f in folds:
        val = [r for r in f.val if labels[r] and all(r in p for p in learned.values())]
        train = [r for r in f.train if labels[r]]
        if not val or not train:
            continue
        for similarity in knn_similarities(search):
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
    free = max(knns, key=lambda k: means[k])  # ties: the first (the search score, the most neighbours)
    chosen: Predictor = free
    reason = f"the best kNN on {len(per[free])} held-out adapters; no learned predictor classifies clearly better"
    if learned:
        best = max(learned, key=lambda k: means[k])
        if clearly_better(per[best], per[free]):
            chosen, reason = best, f"{best.name} classifies {len(per[best])} held-out adapters clearly better than {free.name}"
    prior = class_prior(index[index >= 0], len(classes))
    if isinstance(chosen, KnnPredictor):
        rows = np.flatnonzero(index >= 0).tolist()
        sim = search_similarity(exact, chosen.similarity, z, rows, rows)
        calibration = knn_calibration(sim, index[rows], len(classes), chosen.k, prior)
    else:
        calibration = fit_calibration(oof[chosen], t, prior)
    return Choice(chosen, means, reason), per, calibration


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
    member's embedding."""
    out: dict[LearnedPredictor, dict[int, np.ndarray]] = {PROTOTYPE: {}, LOGREG: {}}
    for f in folds:
        train = [r for r in f.train if labels[r]]
        val = [r for r in f.val if labels[r]]
        if not val or len({labels[r] for r in train}) < 2:
            continue
        out[PROTOTYPE].update(zip(val, prototype_shares(f.z, labels, classes, train, val), strict=True))
        model = logistic_readout(f.z[train], [labels[r] for r in train])
        p = np.zeros((len(val), len(classes)))
        p[:, [classes.index(c) for c in model.classes_]] = model.predict_proba(f.z[val])  # type: ignore[attr-defined]
        out[LOGREG].update(zip(val, p, strict=True))
    return out


def choose_metric(
    exact: dict[str, np.ndarray],
    search: SearchScore,
    values: np.ndarray,
    learned: dict[LearnedPredictor, dict[int, float]],
    folds: list[Fold],
) -> tuple[Choice[Predictor], np.ndarray, np.ndarray]:
    """A kNN among the labelled adapters (as for attributes, by Spearman) or a learned predictor (`learned`: its
    out-of-fold predictions by row, e.g. the heads and a kNN in the W2T embedding), for one metric (values per
    labelled adapter, NaN unknown). Returns the choice, and the chosen predictor's out-of-fold predictions with the truth."""
    knns = [KnnPredictor(sim, k) for sim in knn_similarities(search) for k in KNN_KS]
    preds: dict[Predictor, list[float]] = {**{k: [] for k in knns}, **{k: [] for k in learned}}
    truth: list[float] = []
    for f in folds:
        val = [r for r in f.val if not np.isnan(values[r]) and all(r in p for p in learned.values())]
        train = [r for r in f.train if not np.isnan(values[r])]
        if not val or not train:
            continue
        for similarity in knn_similarities(search):
            sim = search_similarity(exact, similarity, f.z, val, train)
            for k in KNN_KS:
                preds[KnnPredictor(similarity, k)] += knn_regress(sim, values[train], k).tolist()
        for name, p in learned.items():
            preds[name] += [p[r] for r in val]
        truth += values[val].tolist()
    t = np.array(truth)
    per = {k: np.array(v) for k, v in preds.items()}
    means = {k: _spearman(v, t) for k, v in per.items()}
    free = max(knns, key=lambda k: np.nan_to_num(means[k], nan=-2.0))  # ties: the first
    if len(t) >= 5 and learned:
        best = max(learned, key=lambda k: np.nan_to_num(means[k], nan=-2.0))
        if clearly_better_rank(per[best], per[free], t):
            reason = f"{best.name} ranks {len(t)} held-out adapters clearly better than {free.name} (Spearman)"
            return Choice(best, means, reason), per[best], t
    return (
        Choice(free, means, f"the best kNN on {len(t)} held-out adapters; no learned predictor ranks clearly better (Spearman)"),
        per[free],
        t,
    )


def _spearman(pred: np.ndarray, truth: np.ndarray) -> float:
    from scipy.stats import spearmanr  # imported here: every `zoo` command loads this module, few train

    if len(truth) < 2:
        return float("nan")
    if np.ptp(pred) == 0 or np.ptp(truth) == 0:  # a constant ranks nothing
        return -1.0
    return float(np.nan_to_num(spearmanr(pred, truth).statistic, nan=-1.0))


def clearly_better_rank(candidate: np.ndarray, default: np.ndarray, truth: np.ndarray) -> bool:
    """Whether `candidate` ranks like `truth` better than `default` with one-sided 95 % confidence (paired
    bootstrap of the Spearman difference)."""
    if len(truth) < 5 or _spearman(candidate, truth) <= _spearman(default, truth):
        return False
    rng = np.random.default_rng(0)
    gains = []
    for _ in range(RESAMPLES // 2):
        i = rng.integers(0, len(truth), len(truth))
        gains.append(_spearman(candidate[i], truth[i]) - _spearman(default[i], truth[i]))
    return bool(np.quantile(gains, 1 - CONFIDENCE) > 0)
