"""The search score, chosen out of fold (the rule: embed/selection/choice.py).

Every exact score (the whole update's dW cosine, the mean module cosine, the input Gram, and the search's few-label
channel metric where it was fitted in each fold, alone and fused with dW query by query: embed/selection/fitted.py,
zoo/domain/fusion.py), alone and mixed with the W2T cosine at each weight of MIX_WEIGHTS, is scored by each held-out
adapter's MRR + nDCG@10 (relevance = same task) against the labelled adapters, in three guarded steps: the best
training-free score against whole-update dW cosine; the best score that weighs no W2T (the channel metric, its fusion)
against that; then the best W2T mix against that, served only where it is also ahead of the unmixed pick between
adapters one member held out (`among_held_out`). Over the pick, a heavier mix of the same exact score whose top it
re-orders (staged_over), where that is better (a heavier W2T first stage over an unmixed pick: where it is also ahead
between held-out adapters); a channel metric's pick has its top re-ordered by its fusion with dW unless the metric
alone clearly pays (on HEDGE_SURE of the halves).

Why the held-out pairs have a veto: a member trained on the labelled adapters it embeds, and its training gathers each
task's training rows together, so a held-out adapter finds its task among them more easily than a query finds its own
among the zoo's unlabelled adapters, which no member trained on. Scored against the labelled adapters, every W2T mix
looked 0.027-0.052 MRR + nDCG@10 better (against module cosine) than it was on the queries, the channel metric 0.016
(pinned docs-minilm, docs/search.md), and the metric was served mixed with W2T where it was better alone. Between two
adapters one member held out, W2T is as unseen as between a query and the zoo; but those are few, and their small
galleries hold few of an adapter's near twins (which the exact scores find first), so they would favour heavy mixes:
they veto a pick, they do not make it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from embed.selection.choice import MIN_ITEMS, Choice, Fold, best_expected, mean_per_row, scores_for, why_chosen
from embed.selection.metrics import retrieval_per_query
from zoo.domain.channels import EXACT_SCORES
from zoo.domain.methods import SearchScore, fusion_of

#: W2T weights of the mixes tried (1.0: the W2T cosine alone)
MIX_WEIGHTS = tuple(i / 10 for i in range(1, 11))
#: how many first hits of a heavier mix the chosen one-stage score re-orders, in the two-stage searches tried: the
#: heavier mix ranks deep (nDCG@10), the chosen one keeps ordering the first hits (docs/history/results-2026.md)
RERANK_TOPS = (5, 10)
#: the share of held-out halves on which a channel metric alone must beat its top re-ordered by its fusion with dW to
#: be served alone (`hedged`). The labels shaped the metric on the very adapters the choice ranks, so its estimate there
#: is optimistic: where a metric was picked (21 splits of digits-vit-seeded, digits-vit and shapes-cnn), the choice saw
#: the metric alone +0.013 to +0.018 MRR + nDCG@10 above the re-order, the queries −0.002 to +0.005 (docs/search.md)
HEDGE_SURE = 0.95


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


def held_out_together(folds: list[Fold], tasks: list[str]) -> list[tuple[Fold, list[int]]]:
    """Per member, the labelled adapters with a task (`tasks`, "" unknown) it held out, where two or more: pairs its W2T
    cosine trained on neither side of."""
    groups = [(f, [r for r in f.val if tasks[r]]) for f in folds]
    return [(f, rows) for f, rows in groups if len(rows) >= 2]


def with_partner(groups: list[tuple[Fold, list[int]]], tasks: list[str]) -> np.ndarray:
    """Over the (member, held-out adapter) items of `groups` in order: whether another adapter of its group shares its
    task (one with none has nothing to find)."""
    found = [sum(tasks[o] == tasks[r] for o in rows) > 1 for _, rows in groups for r in rows]
    return np.array(found, bool)


def among_held_out(score: SearchScore, exact: dict[str, np.ndarray], tasks: list[str], groups: list[tuple[Fold, list[int]]]) -> np.ndarray:
    """MRR + nDCG@10 of each (member, held-out adapter) item of `groups` searching only the others its member held out,
    by that member's W2T cosine (and the exact scores between them)."""
    second = rerank_values(score, exact)
    parts = [np.zeros(0)]
    for f, rows in groups:
        cut = np.ix_(rows, rows)
        own = np.eye(len(rows), dtype=bool)
        ranking = score.ranking(exact[score.exact][cut], f.z[rows] @ f.z[rows].T, own, None if second is None else second[cut])
        labels = [tasks[r] for r in rows]
        per = retrieval_per_query(ranking, labels, labels, list(range(len(rows))))
        parts.append(per["mrr"] + per["ndcg@10"])
    return np.concatenate(parts)


def choose_search(exact: dict[str, np.ndarray], tasks: list[str], folds: list[Fold]) -> Choice[SearchScore]:
    """The search score, from the labelled adapters' out-of-fold retrieval: `exact` holds each exact score between the
    labelled adapters (n × n; a channel metric's out of fold, embed/selection/fitted.py, whose search metric is a
    candidate where present), `tasks` their tasks ("" unknown). Each held-out adapter with a task queries the labelled
    ones, and each candidate is scored by MRR + nDCG@10. The pick, in three guarded steps (best_expected: choosing so
    must pay on held-out halves): the training-free exact score with the best estimate, against whole-update dW
    cosine; the one-stage score that weighs no W2T (the channel metric, its fusion with dW) with the best estimate,
    against that; then the W2T mix with the best estimate, against that, kept only where it is also ahead of it
    between adapters one member held out (`among_held_out`; the module docstring says why). Among hundreds of
    candidates the best estimate is partly luck: judged against dW alone, a lucky learned mix passed wherever a
    training-free score beats dW. Then, over a pick other than dW cosine, the one of its two-stage searches
    (staged_over) with a better estimate, if any (a heavier W2T first stage over an unmixed pick with the same veto).
    Over a pick that weighs a channel metric, its top re-ordered by the metric's fusion with dW (`hedged`) is the
    reference of that step: it stays unless serving the metric alone pays on HEDGE_SURE of the held-out halves. The
    re-order changes little of the mean MRR + nDCG@10 but keeps first a neighbour that stands out in dW, on the tasks
    where dW is right and the metric is not (docs/search.md); where it stays, it is served (a heavier first stage
    would put the metric alone second). So the guarded one-stage pick is always a stage of the search served. The
    guard weighs the one-stage choice alone: a pick that also chose a first stage on each half is noisier
    (docs/history/results-2026.md, "The guard on the one-stage pick"). The choice's `scores`: every one-stage score
    and the two-stage searches over the pick, against the labelled adapters; its `paired_scores`: those a veto weighed,
    between held-out adapters."""
    flat, w2t = held_out_w2t(folds, {r for r, task in enumerate(tasks) if task})
    reference = SearchScore()  # the whole update's cosine, the training-free bar
    if len(flat) < MIN_ITEMS:
        return Choice(reference, reason=f"{len(flat)} held-out adapters with a task: too few to tell, the whole update's dW cosine")
    quality: dict[SearchScore, np.ndarray] = {}
    paired: dict[SearchScore, np.ndarray] = {}
    own = self_excluded(flat, len(tasks))
    groups = held_out_together(folds, tasks)
    partnered = with_partner(groups, tasks)
    n, n_pairs = len(flat), int(partnered.sum())

    def per_item(score: SearchScore) -> np.ndarray:
        if score not in quality:
            second = rerank_values(score, exact)
            ranking = score.ranking(exact[score.exact][flat], w2t, own, None if second is None else second[flat])
            per = retrieval_per_query(ranking, [tasks[q] for q in flat], tasks, list(flat))
            quality[score] = per["mrr"] + per["ndcg@10"]
        return quality[score]

    def value(score: SearchScore, items: np.ndarray) -> float:
        return float(per_item(score)[items].mean())

    def pair_value(score: SearchScore, items: np.ndarray) -> float:
        if score not in paired:
            paired[score] = among_held_out(score, exact, tasks, groups)[partnered]
        return float(paired[score][items].mean())

    def ahead_among_pairs(mixed: SearchScore, unmixed: SearchScore) -> bool:
        everything = np.arange(n_pairs)
        return n_pairs >= MIN_ITEMS and pair_value(mixed, everything) > pair_value(unmixed, everything)

    weighed = scores_for(exact, "search")
    one_stage = mix_candidates(weighed)
    measure = "MRR + nDCG@10"
    free, free_gain = best_expected([SearchScore(s) for s in EXACT_SCORES], reference, value, n)
    shaped, shaped_gain = best_expected([c for c in one_stage if not c.w2t_weight], free, value, n)
    base, gain = best_expected([c for c in one_stage if c.w2t_weight], shaped, value, n)
    mixes = why_chosen(base, shaped, gain, n, measure, "unmixed")
    if base != shaped and not ahead_among_pairs(base, shaped):
        mixes = f"{shaped.name}: {mixes}, but {_not_ahead(base, shaped, n_pairs)}"
        base = shaped
    reason = (
        f"{mixes}; the second step: {why_chosen(shaped, free, shaped_gain, n, measure)}; "
        f"the first step: {why_chosen(free, reference, free_gain, n, measure)}"
    )
    chosen = base
    if base != reference:
        everything = np.arange(n)
        staged = staged_over(base, weighed)
        kept = base
        if (hedge := hedged(base, staged)) is not None:
            kept, hedge_gain = best_expected([base], hedge, value, n, sure=HEDGE_SURE)
            alone = f"{base.name} alone gained {hedge_gain:+.3f} on the other halves; served alone where it gains on {HEDGE_SURE:.0%}"
            reason = (
                f"{hedge.name}: {reason}; re-ordered by its fusion with dW, which keeps dW's clear neighbours first ({alone})"
                if kept == hedge
                else f"{reason}; not re-ordered by its fusion with dW ({alone})"
            )
        # the hedge is served as it is (a heavier first stage would put the metric alone second); ties: base
        chosen = kept if kept != base else max([base, *staged], key=lambda c: value(c, everything))
        if chosen.w2t_weight and not base.w2t_weight and not ahead_among_pairs(chosen, base):  # a W2T first stage, vetoed
            reason = f"{reason}; {_not_ahead(chosen, base, n_pairs)}"
            chosen = max([base, *(c for c in staged if not c.w2t_weight)], key=lambda c: value(c, everything))
        if chosen != kept:
            reason = (
                f"{chosen.name}: {reason}; re-ordering the top of a heavier first stage estimates better still "
                f"({value(chosen, everything):.3f} against {value(kept, everything):.3f})"
            )
    means = {k: float(v.mean()) for k, v in quality.items()}
    return Choice(chosen, means, reason, {k: float(v.mean()) for k, v in paired.items()})


def _not_ahead(mixed: SearchScore, unmixed: SearchScore, n_pairs: int) -> str:
    """Why a W2T pick is not served."""
    if n_pairs < MIN_ITEMS:
        return f"{mixed.name} is not served: {n_pairs} held-out adapters share a task with another their member held out, too few to tell"
    return f"{mixed.name} is not served: it is not ahead of {unmixed.name} between adapters one member held out ({n_pairs} of them)"
