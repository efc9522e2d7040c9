"""The search score, chosen out of fold (the rule: embed/selection/choice.py).

Every exact score (the whole update's dW cosine, the mean module cosine, the input Gram, the centred input Gram where
its reference was fitted: zoo/domain/centred_gram.py, and the search's few-label
channel metric where it was fitted in each fold, alone and fused with dW query by query: embed/selection/fitted.py,
zoo/domain/fusion.py), alone and mixed with the W2T cosine at each weight of MIX_WEIGHTS, is scored by each held-out
adapter's MRR + nDCG@10 (relevance = same task) against the labelled adapters, in three guarded steps: the best
training-free score against whole-update dW cosine; the best score that weighs no W2T (the channel metric, its fusion)
against that; then the best W2T mix against that, which must pay on SURE of the held-out halves. Over the pick, a
heavier mix of the same exact score whose top it re-orders (staged_over), where that is better (a heavier W2T first
stage over an unmixed pick: where it pays on SURE of the halves); a channel metric's pick has its top re-ordered by its
fusion with dW unless the metric alone pays on SURE of them.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from embed.selection.choice import MIN_ITEMS, Choice, Fold, best_expected, free_scores, mean_per_row, scores_for, why_chosen
from embed.selection.metrics import retrieval_per_query
from zoo.domain.exact_scores import EXACT_SCORES
from zoo.domain.methods import SearchScore, fusion_of

#: W2T weights of the mixes tried (1.0: the W2T cosine alone)
MIX_WEIGHTS = tuple(i / 10 for i in range(1, 11))
#: how many first hits of a heavier mix the chosen one-stage score re-orders, in the two-stage searches tried: the
#: heavier mix ranks deep (nDCG@10), the chosen one keeps ordering the first hits (docs/history/results-2026.md)
RERANK_TOPS = (5, 10)
#: the share of held-out halves on which a candidate the labels shaped must beat its reference to be served over it,
#: where its estimate is known to be optimistic: a W2T mix over the pick that weighs no W2T, and a channel metric alone
#: over its top re-ordered by its fusion with dW (`hedged`). A member trained on the labelled adapters its held-out
#: ones are scored against, and its training gathers each task's rows together, where a query meets mostly adapters no
#: member saw: on pinned docs-minilm (10 splits, 8 labelled a task) every W2T mix's estimate over module cosine was
#: 0.027-0.052 MRR + nDCG@10 above what the queries got, the metric's 0.016; the mixes the plain guard let through
#: cost 0.03-0.11 hit@1 on their splits. Where a metric was picked (21 splits of digits-vit-seeded, digits-vit and
#: shapes-cnn), the choice saw the metric alone +0.013 to +0.018 above the re-order, the queries −0.002 to +0.005
#: (docs/search.md)
SURE = 0.95


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
    ones, and each candidate is scored by MRR + nDCG@10. The pick, in three guarded steps (best_expected: choosing so
    must pay on held-out halves): the training-free exact score with the best estimate, against whole-update dW
    cosine; the one-stage score that weighs no W2T (the channel metric, its fusion with dW) with the best estimate,
    against that; then the W2T mix with the best estimate, against that, where it pays on SURE of the halves (its
    estimate is optimistic: SURE says why). Among hundreds of candidates the best estimate is partly luck: judged
    against dW alone, a lucky learned mix passed wherever a training-free score beats dW. Then, over a pick other than
    dW cosine, the one of its two-stage searches (staged_over) with a better estimate, if any (a heavier W2T first
    stage over an unmixed pick: where it pays on SURE of the halves). Over a pick that weighs a channel metric, its top
    re-ordered by the metric's fusion with dW (`hedged`) is the reference of that step: it stays unless serving the
    metric alone pays on SURE of the held-out halves. The re-order changes little of the mean MRR + nDCG@10 but keeps
    first a neighbour that stands out in dW, on the tasks where dW is right and the metric is not (docs/search.md);
    where it stays, it is served (a heavier first stage would put the metric alone second). So the guarded one-stage
    pick is always a stage of the search served. The guard weighs the one-stage choice alone: a pick that also chose a
    first stage on each half is noisier (docs/history/results-2026.md, "The guard on the one-stage pick"). The
    choice's scores are those of the candidates weighed: every one-stage score, and the two-stage searches over the
    pick."""
    flat, w2t = held_out_w2t(folds, {r for r, task in enumerate(tasks) if task})
    reference = SearchScore()  # the whole update's cosine, the training-free bar
    if len(flat) < MIN_ITEMS:
        return Choice(reference, reason=f"{len(flat)} held-out adapters with a task: too few to tell, the whole update's dW cosine")
    quality: dict[SearchScore, np.ndarray] = {}
    own = self_excluded(flat, len(tasks))
    n = len(flat)

    def value(score: SearchScore, items: np.ndarray) -> float:
        if score not in quality:
            second = rerank_values(score, exact)
            ranking = score.ranking(exact[score.exact][flat], w2t, own, None if second is None else second[flat])
            per = retrieval_per_query(ranking, [tasks[q] for q in flat], tasks, list(flat))
            quality[score] = per["mrr"] + per["ndcg@10"]
        return float(quality[score][items].mean())

    weighed = scores_for(exact, "search")
    one_stage = mix_candidates(weighed)
    measure = "MRR + nDCG@10"
    free, free_gain = best_expected([SearchScore(s) for s in free_scores(exact)], reference, value, n)
    shaped, shaped_gain = best_expected([c for c in one_stage if not c.w2t_weight], free, value, n)
    base, gain = best_expected([c for c in one_stage if c.w2t_weight], shaped, value, n, sure=SURE)
    sure = f"; a W2T mix is served where it gains on {SURE:.0%} of them"
    reason = (
        f"{why_chosen(base, shaped, gain, n, measure, 'unmixed')}{sure}; the second step: "
        f"{why_chosen(shaped, free, shaped_gain, n, measure)}; the first step: {why_chosen(free, reference, free_gain, n, measure)}"
    )
    chosen = base
    if base != reference:
        everything = np.arange(n)
        staged = staged_over(base, weighed)
        kept = base
        if (hedge := hedged(base, staged)) is not None:
            kept, hedge_gain = best_expected([base], hedge, value, n, sure=SURE)
            alone = f"{base.name} alone gained {hedge_gain:+.3f} on the other halves; served alone where it gains on {SURE:.0%}"
            reason = (
                f"{hedge.name}: {reason}; re-ordered by its fusion with dW, which keeps dW's clear neighbours first ({alone})"
                if kept == hedge
                else f"{reason}; not re-ordered by its fusion with dW ({alone})"
            )
        # the hedge is served as it is (a heavier first stage would put the metric alone second); ties: base
        chosen = kept
        if kept == base:
            heavier = [c for c in staged if c.w2t_weight > base.w2t_weight == 0]  # a W2T first stage over an unmixed pick
            chosen = max([base, *(c for c in staged if c not in heavier)], key=lambda c: value(c, everything))
            if heavier:
                chosen = best_expected(heavier, chosen, value, n, sure=SURE)[0]
        if chosen != kept:
            reason = (
                f"{chosen.name}: {reason}; re-ordering the top of a heavier first stage estimates better still "
                f"({value(chosen, everything):.3f} against {value(kept, everything):.3f})"
            )
    means = {k: float(v.mean()) for k, v in quality.items()}
    return Choice(chosen, means, reason)
