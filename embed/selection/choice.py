"""Methods chosen from the data, out of fold: the search score, and each attribute's and metric's predictor.

The rule (DESIGN.md): the candidate with the best expected quality, guarded against the winner's curse. Every
candidate is scored on the labelled adapters, each by the W2T members that never trained on it (one by default;
where several did, their mean cosine or mean prediction), against the labelled adapters. The candidate with the best estimate
is chosen unless choosing that way does not pay out of sample: the pick is replayed on random halves of the
held-out adapters and scored on the other halves, and unless its mean gain there over the training-free
reference is positive, the reference stays. With few
labels (or many candidates of equal worth) the best estimate is mostly noise and loses on the other halves;
with many, the best estimate wins without having to be "clearly" better.

- search: every exact score (the whole update's dW cosine, the mean module cosine, the input Gram, and the search's
  few-label channel metric where it was fitted in each fold, alone and fused with dW query by query:
  embed/selection/fitted.py, zoo/domain/fusion.py) alone and mixed with the W2T cosine at each weight of MIX_WEIGHTS,
  by each held-out adapter's MRR + nDCG@10 (relevance = same task): the best training-free score against whole-update
  dW cosine, then the best of all against that; then, over that pick, a heavier mix of the same exact score whose top
  it re-orders (staged_over), where that is better; a channel metric's pick has its top re-ordered by its fusion with
  dW unless the metric alone clearly pays (on HEDGE_SURE of the halves);
- an attribute: a similarity-weighted kNN among the labelled adapters, its similarity (the search score, or
  an exact score) and k (10, 5, 3, 1: few labels per class want few neighbours) those that classify the
  held-out adapters best, against the W2T heads, few-shot readouts of the W2T embedding (nearest class mean,
  logistic regression on the frozen embedding) and the kNNs by the attribute's channel metric, by accuracy against
  that kNN;
- a metric: the same kNN family, each also weighing its neighbours by a softmax at each of KNN_TEMPERATURES (best
  Spearman), against the heads, the kNN in the W2T embedding and the kNNs by the metric's channel metric, by
  Spearman against that kNN.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

from embed.selection.calibration import Calibration, class_prior, knn_calibration, leave_one_out_shares, with_earned_sure
from embed.selection.calibration import fit as fit_calibration
from embed.selection.metrics import KNN_K, knn_regress, knn_vote_shares, retrieval_per_query
from zoo.domain.channels import EXACT_SCORES
from zoo.domain.methods import (
    LOGREG,
    PROTOTYPE,
    KnnPredictor,
    LearnedPredictor,
    Predictor,
    SearchScore,
    fitted_score,
    fused_score,
    fusion_of,
)

#: W2T weights of the mixes tried (1.0: the W2T cosine alone)
MIX_WEIGHTS = tuple(i / 10 for i in range(1, 11))
#: how many first hits of a heavier mix the chosen one-stage score re-orders, in the two-stage searches tried: the
#: heavier mix ranks deep (nDCG@10), the chosen one keeps ordering the first hits (docs/history/results-2026.md)
RERANK_TOPS = (5, 10)
#: neighbours tried by the kNN predictors, in order of preference on a tie
KNN_KS = (KNN_K, 5, 3, 1)
#: softmax temperatures a metric's kNN candidates weigh their neighbours at (beside max(s, 0)): on digits-vit-seeded,
#: input-Gram 10-NN weights by max(s, 0) are nearly equal, and a temperature chosen on the labelled adapters took its
#: performance Spearman from 0.636 to 0.709 (docs/history/results-2026.md, "Performance Spearman: the kNN's weights")
KNN_TEMPERATURES = (0.003, 0.01, 0.03, 0.1)
#: temperature of the nearest-class-mean readout's softmax over cosines
PROTOTYPE_TEMPERATURE = 0.1
#: random halves of the held-out adapters the choice is replayed on, to estimate what choosing by the best estimate gains
HALVES = 200
#: fewer held-out adapters than this tell nothing: the reference stays
MIN_ITEMS = 5
#: the share of held-out halves on which a channel metric alone must beat its top re-ordered by its fusion with dW to
#: be served alone (`hedged`). The labels shaped the metric on the very adapters the choice ranks, so its estimate there
#: is optimistic: where a metric was picked (21 splits of digits-vit-seeded, digits-vit and shapes-cnn), the choice saw
#: the metric alone +0.013 to +0.018 MRR + nDCG@10 above the re-order, the queries −0.002 to +0.005 (docs/search.md)
HEDGE_SURE = 0.95


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


def knn_similarities(similarity: SearchScore, exact: Iterable[str] = EXACT_SCORES) -> list[SearchScore]:
    """The similarities a kNN predictor may use: `similarity` (a one-stage score: knn_similarity) first, then the
    exact scores `exact` (the training-free ones, and the target's own channel metric where it has one)."""
    return [similarity, *(s for s in map(SearchScore, exact) if s != similarity)]


def scores_for(exact: dict[str, np.ndarray], purpose: str) -> tuple[str, ...]:
    """The exact scores a purpose ("search" or a target) weighs: the training-free ones, then its own channel metric
    and that metric fused with dW, where `exact` holds their out-of-fold similarity (embed/selection/fitted.py)."""
    return (*EXACT_SCORES, *(s for s in (fitted_score(purpose), fused_score(purpose)) if s in exact))


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


def _why(chosen: SearchScore | Predictor, reference: SearchScore | Predictor, gain: float, n: int, measure: str) -> str:
    if chosen == reference:
        return (
            f"{reference.name}: choosing by the best estimate on half of {n} held-out adapters gained {gain:+.3f} "
            f"({measure}) on the other half, so the training-free {reference.name} stays"
        )
    return (
        f"{chosen.name} has the best expected {measure} on {n} held-out adapters (choosing so on half of them gained "
        f"{gain:+.3f} over {reference.name} on the other half)"
    )


def mix_candidates(exact: Iterable[str] = EXACT_SCORES) -> list[SearchScore]:
    """The one-stage search scores, simplest first: each exact score, then the mixes by W2T weight."""
    scores = tuple(exact)
    return list(dict.fromkeys(SearchScore(score, w) for w in (0.0, *MIX_WEIGHTS) for score in scores))


def staged_over(score: SearchScore, exact: Iterable[str] = EXACT_SCORES) -> list[SearchScore]:
    """The two-stage searches over `score` (one stage, not W2T alone), among the exact scores `exact`: a heavier mix of
    its exact score (each weight of MIX_WEIGHTS above its own, below 1) finds, `score` re-orders its first
    RERANK_TOPS; and where `score` weighs a channel metric whose fusion with dW is in `exact`, `score` finds and the
    fusion at its weight re-orders its first RERANK_TOPS (a neighbour that stands out in dW first)."""
    if score.second_stage is not None or score.w2t_weight >= 1:
        return []
    w = score.w2t_weight
    heavier = [SearchScore(score.exact, heavy, w, top) for heavy in MIX_WEIGHTS if w < heavy < 1 for top in RERANK_TOPS]
    fused = fusion_of(score.exact)
    return [*heavier, *(SearchScore(score.exact, w, w, top, fused) for top in RERANK_TOPS if fused in set(exact))]


def hedged(score: SearchScore, staged: Iterable[SearchScore]) -> SearchScore | None:
    """Among `score`'s two-stage searches, the one whose fusion with dW re-orders its first hits (the shallowest of
    RERANK_TOPS), where `score` weighs a channel metric whose fusion is among them: the hedge the choice serves unless
    the metric alone clearly pays (choose_search)."""
    fused = [s for s in staged if s.rerank_exact is not None]  # a second stage by another score is the metric's fusion
    return min(fused, key=lambda s: s.rerank_top, default=None)


def search_candidates(exact: Iterable[str] = EXACT_SCORES) -> list[SearchScore]:
    """Every search score the choice can make over the exact scores `exact`, simplest first: the one-stage ones, then
    each one's two-stage searches (staged_over)."""
    scores = tuple(exact)
    one = mix_candidates(scores)
    return [*one, *(s for c in one for s in staged_over(c, scores))]


def rerank_values(score: SearchScore, exact: dict[str, np.ndarray]) -> np.ndarray | None:
    """The values of the exact score a search's second stage re-orders by, where it is not its first's."""
    return None if score.rerank_exact is None else exact[score.rerank_exact]


def self_excluded(queries: list[int], n: int) -> np.ndarray:
    """The mask (len(queries) × n) of each query's own column: what it may not return."""
    mask = np.zeros((len(queries), n), bool)
    mask[np.arange(len(queries)), queries] = True
    return mask


def mean_per_row(values: Iterable[tuple[int, np.ndarray]]) -> dict[int, np.ndarray]:
    """Each row's mean of its (row, value) pairs, rows in the order they first come: what the members that held a
    row out say of it, as one."""
    by_row: dict[int, list[np.ndarray]] = {}
    for r, v in values:
        by_row.setdefault(r, []).append(v)
    return {r: np.mean(v, axis=0) for r, v in by_row.items()}


def held_out_w2t(folds: list[Fold], rows: set[int]) -> tuple[list[int], np.ndarray]:
    """The `rows` some member held out, in the order the folds first hold them out, and their W2T cosine to every
    labelled adapter (len × n): the mean of the cosines of the members that held each out (one by default; two for
    ten members each holding out a fifth, embed.training.train), as the served cosine is the mean of all the members'."""
    vals = [[r for r in f.val if r in rows] for f in folds]
    sims = mean_per_row((r, sim) for f, val in zip(folds, vals, strict=True) for r, sim in zip(val, f.z[val] @ f.z.T, strict=True))
    n = len(folds[0].z) if folds else 0
    return list(sims), np.stack(list(sims.values())) if sims else np.zeros((0, n))


def choose_search(exact: dict[str, np.ndarray], tasks: list[str], folds: list[Fold]) -> Choice[SearchScore]:
    """The search score, from the labelled adapters' out-of-fold retrieval: `exact` holds each exact score between the
    labelled adapters (n × n; a channel metric's out of fold, embed/selection/fitted.py, whose search metric is a
    candidate where present), `tasks` their tasks ("" unknown). Each held-out adapter with a task queries the labelled
    ones, and each candidate is scored by MRR + nDCG@10. The pick, in two guarded steps (best_expected: choosing so
    must pay on held-out halves): the training-free exact score with the best estimate, against whole-update dW
    cosine; then the one-stage score with the best estimate among all (W2T mixes, the channel metric), against that
    pick. Among hundreds of candidates the best estimate is partly luck: judged against dW alone, a lucky learned mix
    passed wherever a training-free score beats dW (docs-minilm: heavy W2T mixes chosen where module cosine was the
    best single score, and behind it on the queries). Then, over a pick other than dW cosine, the one of its two-stage
    searches (staged_over) with a better estimate, if any. Over a pick that weighs a channel metric, its top
    re-ordered by the metric's fusion with dW (`hedged`) is the reference of that step: it stays unless serving the
    metric alone pays on HEDGE_SURE of the held-out halves. The re-order changes little of the mean MRR + nDCG@10 but
    keeps first a neighbour that stands out in dW, on the tasks where dW is right and the metric is not
    (docs/search.md); where it stays, it is served (a heavier first stage would put the metric alone second). So the
    guarded one-stage pick is always a stage of the search served. The guard weighs the one-stage choice alone: a pick
    that also chose a first stage on each half is noisier, and on few labels failed the guard where the one-stage pick
    passes (docs/history/results-2026.md, "The guard on the one-stage pick"). The choice's scores are those of the
    candidates weighed: every one-stage score, and the two-stage searches over the pick."""
    flat, w2t = held_out_w2t(folds, {r for r, task in enumerate(tasks) if task})
    reference = SearchScore()  # the whole update's cosine, the training-free bar
    if len(flat) < MIN_ITEMS:
        return Choice(reference, reason=f"{len(flat)} held-out adapters with a task: too few to tell, the whole update's dW cosine")
    quality: dict[SearchScore, np.ndarray] = {}
    own = self_excluded(flat, len(tasks))

    def per_item(score: SearchScore) -> np.ndarray:
        if score not in quality:
            second = rerank_values(score, exact)
            ranking = score.ranking(exact[score.exact][flat], w2t, own, None if second is None else second[flat])
            per = retrieval_per_query(ranking, [tasks[q] for q in flat], tasks, list(flat))
            quality[score] = per["mrr"] + per["ndcg@10"]
        return quality[score]

    def value(score: SearchScore, items: np.ndarray) -> float:
        return float(per_item(score)[items].mean())

    weighed = scores_for(exact, "search")
    free, free_gain = best_expected([SearchScore(s) for s in EXACT_SCORES], reference, value, len(flat))
    base, gain = best_expected(mix_candidates(weighed), free, value, len(flat))
    measure = "MRR + nDCG@10"
    reason = f"{_why(base, free, gain, len(flat), measure)}; the first step: {_why(free, reference, free_gain, len(flat), measure)}"
    chosen = base
    if base != reference:
        everything = np.arange(len(flat))
        staged = staged_over(base, weighed)
        kept = base
        if (hedge := hedged(base, staged)) is not None:
            kept, hedge_gain = best_expected([base], hedge, value, len(flat), sure=HEDGE_SURE)
            alone = f"{base.name} alone gained {hedge_gain:+.3f} on the other halves; served alone where it gains on {HEDGE_SURE:.0%}"
            reason = (
                f"{hedge.name}: {reason}; re-ordered by its fusion with dW, which keeps dW's clear neighbours first ({alone})"
                if kept == hedge
                else f"{reason}; not re-ordered by its fusion with dW ({alone})"
            )
        # the hedge is served as it is (a heavier first stage would put the metric alone second); ties: base
        chosen = kept if kept != base else max([base, *staged], key=lambda c: value(c, everything))
        if chosen != kept:
            reason = (
                f"{chosen.name}: {reason}; re-ordering the top of a heavier first stage estimates better still "
                f"({value(chosen, everything):.3f} against {value(kept, everything):.3f})"
            )
    means = {k: float(v.mean()) for k, v in quality.items()}
    return Choice(chosen, means, reason)


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
        reason = _why(chosen, free, value, len(t), "accuracy") + (" (the best kNN)" if chosen == free else "")
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
) -> tuple[Choice[Predictor], np.ndarray, np.ndarray]:
    """A kNN among the labelled adapters (as for attributes, and at each temperature of KNN_TEMPERATURES, by
    Spearman; the kNNs by the `target` metric's own
    channel metric, where `exact` holds it, weighed against it as learned predictors are) or a learned predictor
    (`learned`: its out-of-fold predictions by row, e.g. the heads and a kNN in the W2T embedding), for one metric
    (values per labelled adapter, NaN unknown). Returns the choice, and the chosen predictor's out-of-fold
    predictions with the truth."""
    similarities = knn_similarities(search, scores_for(exact, target))
    knns = [KnnPredictor(sim, k, temp) for sim in similarities for k in KNN_KS for temp in (None, *KNN_TEMPERATURES)]
    preds: dict[Predictor, list[float]] = {**{k: [] for k in knns}, **{k: [] for k in learned}}
    truth: list[float] = []
    for f in folds:
        val = [r for r in f.val if not np.isnan(values[r]) and all(r in p for p in learned.values())]
        train = [r for r in f.train if not np.isnan(values[r])]
        if not val or not train:
            continue
        for similarity in similarities:
            sim = search_similarity(exact, similarity, f.z, val, train)
            for k in KNN_KS:
                for temp in (None, *KNN_TEMPERATURES):
                    preds[KnnPredictor(similarity, k, temp)] += knn_regress(sim, values[train], k, temp).tolist()
        for name, p in learned.items():
            preds[name] += [p[r] for r in val]
        truth += values[val].tolist()
    t = np.array(truth)
    per = {k: np.array(v) for k, v in preds.items()}
    means = {k: _spearman(v, t) for k, v in per.items()}
    free, weighed = _knn_reference(knns, learned, lambda k: float(np.nan_to_num(means[k], nan=-2.0)))
    if len(t) < MIN_ITEMS or not weighed:
        return Choice(free, means, f"the best kNN on {len(t)} held-out adapters, too few to weigh a learned predictor"), per[free], t
    chosen, value = best_expected(weighed, free, lambda c, items: _spearman(per[c][items], t[items]), len(t))
    reason = _why(chosen, free, value, len(t), "Spearman") + (" (the best kNN)" if chosen == free else "")
    return Choice(chosen, means, reason), per[chosen], t


def _spearman(pred: np.ndarray, truth: np.ndarray) -> float:
    from scipy.stats import spearmanr  # imported here: every `zoo` command loads this module, few train

    if len(truth) < 2:
        return float("nan")
    if np.ptp(pred) == 0 or np.ptp(truth) == 0:  # a constant ranks nothing
        return -1.0
    return float(np.nan_to_num(spearmanr(pred, truth).statistic, nan=-1.0))
