"""The search choice studied offline: W2T trained once per split, every rule replayed on the same scores.

`python -m bench.choice dump --data-dir D --labelled-per-task N --splits 5 --out F.npz` trains the default W2T per split
as `zoo eval` does (the same splits, the same seeds) and saves what a rule needs: each member's embedding of every
adapter, each member's fold, the split, the tasks and the exact scores. `python -m bench.choice study F.npz...` then
replays each rule of RULES on each split: it chooses from the labelled adapters' out-of-fold retrieval (as
embed.selection.search_choice.choose_search does), and what it chose is scored on the split's queries against every adapter, with the
served embedding (the members' mean cosine). Per dump and rule: the mean regret against the best fixed candidate of
the live candidates, its 90th percentile, and the gain over dW cosine (hit@1, MRR, nDCG@10), beside the live rule
measured in the same run, the floor the splits' own noise leaves (cross_split_floor) and the one a single search for
all three measures leaves (one_for_all); a table, then the figures as one JSON object on the last line. A dump takes a
W2T training per split; a study takes a few minutes. `study --join` studies several dumps of one zoo (made with other
--seed) as one, for more splits than one dump holds.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embed.selection.choice import Fold, best_expected
from embed.selection.metrics import retrieval_per_query
from embed.selection.search_choice import (
    MIX_WEIGHTS,
    choose_search,
    held_out_w2t,
    mix_candidates,
    rerank_values,
    search_candidates,
    self_excluded,
    staged_over,
)
from zoo.domain.exact_scores import EXACT_SCORES
from zoo.domain.methods import SearchScore

MEASURES = ("hit@1", "mrr", "ndcg@10")


def dump(args: argparse.Namespace) -> None:
    """Train per split as `zoo eval` does and save the scores a rule needs."""
    from embed.data.dataset import load_adapters
    from embed.data.types import ZooAdapter, schema_of, split_positions
    from embed.serving.resources import resolve_base_model
    from embed.training.splits import labelled_split
    from embed.training.train import member_folds, train_w2t
    from embed.training.train_options import TrainOptions
    from embed.w2t.ensemble import W2TEnsemble
    from zoo.config import Settings
    from zoo.domain.exact_scores import exact_cosines
    from zoo.domain.similarity import ModuleStack, dense_modules
    from zoo.labels import TASK_KEY
    from zoo.store.blobs import BlobStore
    from zoo.store.session import session_factory

    settings = Settings.load(None, args.data_dir)
    with session_factory(settings.database_url)() as session:
        space = resolve_base_model(session, args.space)
        adapters = load_adapters(session, BlobStore(settings.blob_dir), space)
    schema = schema_of(space, adapters)
    factors = [a.factors for a in adapters]
    stack = ModuleStack.of(factors, dense_modules(factors))
    saved: dict[str, np.ndarray] = {f"exact_{s}": exact_cosines(stack, stack, s).astype(np.float32) for s in EXACT_SCORES}
    saved["tasks"] = np.array([a.labels.get(TASK_KEY, "") for a in adapters])
    for seed in range(args.seed, args.seed + args.splits):
        if args.labelled_per_task is not None:
            train_pos, test_pos = labelled_split(adapters, args.labelled_per_task, None, seed)
            held = set(test_pos)
            fit = [ZooAdapter(a.id, a.name, a.factors, {}, {}, a.source_uri) if p in held else a for p, a in enumerate(adapters)]
            fit_pos = list(range(len(adapters)))
        else:
            train_pos, test_pos = split_positions(adapters, 0.2, seed)
            fit, fit_pos = [adapters[p] for p in train_pos], list(train_pos)
        given = {
            k: v
            for k, v in (
                ("members", args.members),
                ("val_fraction", args.val_fraction),
                ("augment_rescale", args.augment_rescale),
                ("augment_module_dropout", args.augment_module_dropout),
                ("augment_mixup", args.augment_mixup),
                ("unlabelled_per_labelled", args.unlabelled_per_labelled),
            )
            if v is not None
        }
        options = TrainOptions(epochs=args.epochs, seed=seed, objective=args.objective, **given)
        emb = train_w2t(fit, schema, options, progress=False)
        members = [W2TEnsemble([m], emb.schema, emb.rank, emb.metric_stats, emb.objective).embed(adapters) for m in emb.models]
        saved[f"s{seed}_z"] = np.stack(members).astype(np.float32)
        for i, f in enumerate(member_folds(len(fit), len(emb.models), options)):
            saved[f"s{seed}_val{i}"] = np.array([fit_pos[r] for r in f.val.tolist()], np.int64)
        saved[f"s{seed}_train"] = np.array(train_pos, np.int64)
        saved[f"s{seed}_test"] = np.array(test_pos, np.int64)
        saved[f"s{seed}_chosen"] = np.array(emb.search.name)
        print(f"split {seed}: {emb.search.name}", flush=True)
    saved["seeds"] = np.arange(args.seed, args.seed + args.splits)
    np.savez_compressed(args.out, **saved)  # type: ignore[arg-type]


@dataclass
class Split:
    """One split of a dump: the labelled adapters' out-of-fold views and the served scores."""

    seed: int
    tasks: list[str]
    labelled: list[int]
    queries: list[int]
    folds: list[Fold]
    exact: dict[str, np.ndarray]
    served_w2t: np.ndarray
    chosen_live: str

    @classmethod
    def load(cls, data: np.lib.npyio.NpzFile, seed: int) -> Split:
        tasks = data["tasks"].tolist()
        z = data[f"s{seed}_z"].astype(np.float64)
        labelled = data[f"s{seed}_train"].tolist()
        at = {r: i for i, r in enumerate(labelled)}
        folds = []
        for m in range(len(z)):
            val = [at[r] for r in data[f"s{seed}_val{m}"].tolist() if r in at]
            rest = sorted(set(range(len(labelled))) - set(val))
            folds.append(Fold(val, rest, z[m][labelled]))
        exact = {s: data[f"exact_{s}"].astype(np.float64) for s in EXACT_SCORES}
        served = np.mean([zm @ zm.T for zm in z], axis=0)
        queries = [q for q in data[f"s{seed}_test"].tolist() if tasks[q]]
        return cls(seed, tasks, labelled, queries, folds, exact, served, str(data[f"s{seed}_chosen"]))


Candidate = SearchScore


def similarity(
    c: Candidate, exact: dict[str, np.ndarray], w2t: np.ndarray, self_index: list[int], keep: np.ndarray | None = None
) -> np.ndarray:
    """A candidate's ranking keys (queries × gallery, SearchScore.ranking) from the exact scores and the W2T cosine of
    the same rows; each query's own column, and gallery items not in `keep` (where given), are excluded."""
    excluded = self_excluded(self_index, w2t.shape[1])
    if keep is not None:
        excluded |= ~keep
    return c.ranking(exact[c.exact], w2t, excluded, rerank_values(c, exact))


def served(split: Split, c: Candidate) -> dict[str, float]:
    """The candidate's retrieval on the split's queries against every adapter, as `zoo eval` measures it."""
    q = split.queries
    sim = similarity(c, {s: m[q] for s, m in split.exact.items()}, split.served_w2t[q], q)
    per = retrieval_per_query(sim, [split.tasks[i] for i in q], split.tasks, list(q))
    return {k: float(per[k].mean()) for k in MEASURES}


def out_of_fold(split: Split, candidates: list[Candidate]) -> dict[Candidate, dict[str, np.ndarray]]:
    """Each candidate's per-query retrieval among the labelled adapters, out of fold (as choose_search)."""
    tasks = [split.tasks[r] for r in split.labelled]
    flat, w2t = held_out_w2t(split.folds, {r for r, task in enumerate(tasks) if task})
    exact = {s: m[np.ix_(split.labelled, split.labelled)][flat] for s, m in split.exact.items()}
    return {c: retrieval_per_query(similarity(c, exact, w2t, flat), [tasks[q] for q in flat], tasks, list(flat)) for c in candidates}


Scores = dict[Candidate, dict[str, np.ndarray]]


def total(per: dict[str, np.ndarray], measures: tuple[str, ...]) -> np.ndarray:
    """Per query, the sum of `measures`."""
    return np.sum([per[k] for k in measures], axis=0)


def estimated(oof: Scores, measures: tuple[str, ...] = ("mrr", "ndcg@10")) -> tuple[Callable[[Candidate, np.ndarray], float], int]:
    """A rule's estimate: each candidate's mean sum of `measures` over the held-out items given, and how many there are."""
    quality = {c: total(per, measures) for c, per in oof.items()}

    def value(c: Candidate, items: np.ndarray) -> float:
        return float(quality[c][items].mean())

    return value, len(next(iter(quality.values())))


Rule = Callable[[Split, Scores], Candidate]


def live(split: Split, oof: Scores) -> Candidate:
    """embed.selection.search_choice.choose_search itself."""
    tasks = [split.tasks[r] for r in split.labelled]
    exact = {s: m[np.ix_(split.labelled, split.labelled)] for s, m in split.exact.items()}
    return choose_search(exact, tasks, split.folds).chosen


def by_sum(measures: tuple[str, ...], among: Callable[[], Sequence[Candidate]]) -> Rule:
    """The best estimate of the sum of `measures` among `among()`, guarded by the replay on halves (best_expected)."""

    def rule(split: Split, oof: Scores) -> Candidate:
        quality = {c: total(oof[c], measures) for c in among()}
        n = len(next(iter(quality.values())))
        reference: Candidate = SearchScore()
        return best_expected(list(quality), reference, lambda c, items: float(quality[c][items].mean()), n)[0]

    return rule


def tiered(measures: tuple[str, ...] = ("mrr", "ndcg@10")) -> Rule:
    """Two guarded steps: first the training-free exact scores (the best estimate against dW cosine, replayed on
    halves), then every candidate against that one, replayed on halves the same way."""

    def rule(split: Split, oof: Scores) -> Candidate:
        value, n = estimated(oof, measures)
        free = [SearchScore(e) for e in EXACT_SCORES]
        reference = best_expected(free, SearchScore(), value, n)[0]
        return best_expected(search_candidates(), reference, value, n)[0]

    return rule


def leaning(t: float, measures: tuple[str, ...] = ("mrr", "ndcg@10")) -> Rule:
    """The best estimate, then the mix of the same exact score with the most W2T weight whose paired estimate is
    within `t` standard errors of it (out of fold W2T is one member's cosine against adapters it trained on; the
    served one is the members' mean against mostly unseen ones), guarded by the replay on halves."""

    def rule(split: Split, oof: Scores) -> Candidate:
        quality = {c: total(oof[c], measures) for c in mix_candidates()}
        n = len(next(iter(quality.values())))
        reference = SearchScore()

        def pick(items: np.ndarray) -> SearchScore:
            best = max(quality, key=lambda c: (float(quality[c][items].mean()), c == reference))
            assert isinstance(best, SearchScore)
            chosen = best
            for c in quality:
                assert isinstance(c, SearchScore)
                if c.w2t_weight <= chosen.w2t_weight or (c.exact != best.exact and c.w2t_weight < 1):
                    continue
                diff = quality[c][items] - quality[best][items]
                if diff.mean() >= -t * diff.std() / np.sqrt(len(items)):
                    chosen = c
            return chosen

        return best_expected(list(quality), reference, lambda c, items: float(quality[c][items].mean()), n, pick)[0]

    return rule


def ranked(scores: np.ndarray, relevant: np.ndarray) -> dict[str, float]:
    """hit@1, MRR and nDCG@10 of one query's scores (excluded items at -inf) against a relevance mask."""
    order = np.argsort(-scores, kind="stable")
    order = order[np.isfinite(scores[order])]
    rel = relevant[order].astype(np.float64)
    n_rel = int(rel.sum())
    if n_rel == 0:
        return {}
    discounts = 1.0 / np.log2(np.arange(2, 12))
    top = rel[:10]
    return {
        "hit@1": float(rel[0]),
        "mrr": 1.0 / (int(np.argmax(rel)) + 1),
        "ndcg@10": float((top * discounts[: len(top)]).sum() / discounts[: min(10, n_rel)].sum()),
    }


def honest_out_of_fold(split: Split, candidates: Sequence[Candidate] | None = None) -> Scores:
    """Out of fold against unseen relevant adapters only: a held-out labelled adapter of member m queries every
    labelled adapter but the ones of its own task that m trained on, so that what it must find is, as for a served
    query, an adapter no member's training saw next to it."""
    tasks = np.array([split.tasks[r] for r in split.labelled])
    exact = {s: m[np.ix_(split.labelled, split.labelled)] for s, m in split.exact.items()}
    cands = list(candidates) if candidates is not None else list(search_candidates())
    per: dict[Candidate, dict[str, list[float]]] = {c: {k: [] for k in MEASURES} for c in cands}
    for f in split.folds:
        honest = np.zeros(len(tasks), bool)
        honest[f.val] = True
        for q in f.val:
            if not tasks[q]:
                continue
            same = tasks == tasks[q]
            keep = ~(same & ~honest)
            keep[q] = False
            if not (keep & same).any():
                continue
            w2t = (f.z[q] @ f.z.T)[None]
            row_exact = {s: m[q][None] for s, m in exact.items()}
            for c in cands:
                got = ranked(similarity(c, row_exact, w2t, [q], keep[None])[0], same)
                for k in MEASURES:
                    per[c][k].append(got[k])
    return {c: {k: np.array(v) for k, v in m.items()} for c, m in per.items()}


def honest(measures: tuple[str, ...] = ("mrr", "ndcg@10"), among: Callable[[], Sequence[Candidate]] = search_candidates) -> Rule:
    """The best estimate out of fold against unseen relevant adapters (honest_out_of_fold), replayed on halves."""

    def rule(split: Split, oof: Scores) -> Candidate:
        scores = honest_out_of_fold(split, among())
        quality: dict[Candidate, np.ndarray] = {c: total(scores[c], measures) for c in among()}
        n = len(next(iter(quality.values())))
        if n < 5:
            return SearchScore()
        reference: Candidate = SearchScore()
        return best_expected(list(quality), reference, lambda c, items: float(quality[c][items].mean()), n)[0]

    return rule


def served_honest_share(split: Split) -> float:
    """The share of a served query's gallery that no member trained on: the adapters without a label."""
    labelled = len(split.labelled)
    return (len(split.tasks) - labelled) / max(len(split.tasks) - 1, 1)


def mixed(measures: tuple[str, ...] = ("mrr", "ndcg@10"), share: float | None = None) -> Rule:
    """The two out-of-fold estimates (against the labelled adapters as they are; against unseen relevant ones only)
    mixed in the served query's proportions (the unlabelled share), best expected, replayed on halves of each."""

    def rule(split: Split, oof: Scores) -> Candidate:
        h = served_honest_share(split) if share is None else share
        unseen = honest_out_of_fold(split)
        parts = [
            ({c: total(oof[c], measures) for c in search_candidates()}, 1 - h),
            ({c: total(unseen[c], measures) for c in search_candidates()}, h),
        ]
        parts = [(q, w) for q, w in parts if len(next(iter(q.values()))) >= 5 and w > 0]
        reference = SearchScore()

        def value(c: SearchScore, items: list[np.ndarray]) -> float:
            weights = sum(w for _, w in parts)
            return float(sum(w * float(q[c][i].mean()) for (q, w), i in zip(parts, items, strict=True))) / weights

        def pick(items: list[np.ndarray]) -> SearchScore:
            return max(search_candidates(), key=lambda c: (value(c, items), c == reference))

        rng = np.random.default_rng(0)
        gains = []
        for _ in range(200):
            perms = [rng.permutation(len(next(iter(q.values())))) for q, _ in parts]
            a = [p[: len(p) // 2] for p in perms]
            b = [p[len(p) // 2 :] for p in perms]
            gains.append(value(pick(a), b) - value(reference, b))
        whole = [np.arange(len(next(iter(q.values())))) for q, _ in parts]
        return pick(whole) if np.mean(gains) > 0 else reference

    return rule


def smoothed(degree: int = 2, measures: tuple[str, ...] = ("mrr", "ndcg@10")) -> Rule:
    """Per exact score, a polynomial in the W2T weight fitted to the out-of-fold estimates over the weights; the
    candidate at the best fitted value, replayed on halves against dW cosine."""

    def rule(split: Split, oof: Scores) -> Candidate:
        quality = {c: total(oof[c], measures) for c in search_candidates()}
        n = len(next(iter(quality.values())))
        reference = SearchScore()
        grid = [0.0, *MIX_WEIGHTS]

        def fitted(items: np.ndarray) -> dict[SearchScore, float]:
            out: dict[SearchScore, float] = {}
            for e in EXACT_SCORES:
                cands = [SearchScore(e, w) for w in grid]
                y = np.array([quality[c][items].mean() for c in cands])
                coef = np.polyfit(grid, y, degree)
                for c, v in zip(cands, np.polyval(coef, grid), strict=True):
                    out[c] = max(out.get(c, -np.inf), float(v))
            return out

        def pick(items: np.ndarray) -> SearchScore:
            f = fitted(items)
            return max(f, key=lambda c: (f[c], c == reference))

        return best_expected(list(quality), reference, lambda c, items: float(quality[c][items].mean()), n, pick)[0]

    return rule


def bagged(measures: tuple[str, ...] = ("mrr", "ndcg@10")) -> Rule:
    """Bagged choice (Efron 2014, "Estimation and accuracy after model selection"): the best estimate is found on 200
    bootstrap resamples of the held-out adapters; the exact score found most often (W2T alone counts for each) is
    taken at the mean of the W2T weights found with it, to the nearest tenth; replayed on halves like the live rule."""

    def rule(split: Split, oof: Scores) -> Candidate:
        cands = search_candidates()
        table = np.stack([total(oof[c], measures) for c in cands], axis=1)
        reference = SearchScore()

        def pick(items: np.ndarray) -> SearchScore:
            counts = np.random.default_rng(0).multinomial(len(items), np.full(len(items), 1 / len(items)), size=200)
            found = [cands[i] for i in np.argmax(counts @ table[items], axis=1)]
            votes = Counter(e for c in found for e in ((c.exact,) if c.w2t_weight < 1 else EXACT_SCORES))
            exact = max(EXACT_SCORES, key=lambda e: votes[e])
            weight = float(np.mean([c.w2t_weight for c in found if c.exact == exact or c.w2t_weight == 1]))
            return SearchScore(exact, float(np.floor(weight * 10 + 0.5)) / 10)

        return best_expected(cands, reference, lambda c, items: float(table[items, cands.index(c)].mean()), len(table), pick)[0]

    return rule


def all_at_once_candidates() -> list[Candidate]:
    """The candidates of a rule that weighs them all at once: the one-stage ones and a fixed grid of two-stage searches
    (first stage 0.5-0.9, second 0-0.3, top 5 or 10; all among today's search_candidates())."""
    firsts, seconds = (0.5, 0.6, 0.7, 0.8, 0.9), (0.0, 0.1, 0.2, 0.3)
    staged = [SearchScore(e, w, r, top) for e in EXACT_SCORES for w in firsts for r in seconds for top in (5, 10)]
    return [*mix_candidates(), *staged]


def around(measures: tuple[str, ...] = ("mrr", "ndcg@10")) -> Rule:
    """The best one-stage score, then the best of the two-stage searches it is either stage of (a heavier mix under
    it, as the live rule, or a lighter mix re-ordering its own top), where one estimates better; replayed on halves."""

    def rule(split: Split, oof: Scores) -> Candidate:
        one = mix_candidates()
        value, n = estimated(oof, measures)

        def pick(items: np.ndarray) -> SearchScore:
            base = max(one, key=lambda c: value(c, items))
            lighter = [r for r in (0.0, *MIX_WEIGHTS) if r < base.w2t_weight < 1]
            under = [SearchScore(base.exact, base.w2t_weight, r, top) for r in lighter for top in (5, 10)]
            return max([base, *staged_over(base), *under], key=lambda c: value(c, items))

        return best_expected(one, SearchScore(), value, n, pick)[0]

    return rule


def not_behind_first_hits(split: Split, oof: Scores) -> Candidate:
    """The live rule's two steps among the candidates whose estimated hit@1 and MRR are not below dW cosine's on the
    items they are picked from; replayed on halves like the live rule."""
    one = mix_candidates()
    reference = SearchScore()
    value, n = estimated(oof)

    def keeps_up(c: Candidate, items: np.ndarray) -> bool:
        return all(oof[c][k][items].mean() >= oof[reference][k][items].mean() for k in ("hit@1", "mrr"))

    def pick(items: np.ndarray) -> SearchScore:
        base = max([c for c in one if keeps_up(c, items)] or [reference], key=lambda c: value(c, items))
        return max([base, *(c for c in staged_over(base) if keeps_up(c, items))], key=lambda c: value(c, items))

    return best_expected(one, reference, value, n, pick)[0]


def nested(split: Split, oof: Scores) -> Candidate:
    """The live rule's two steps, each guarded on its own: the best one-stage score against dW cosine (replayed on
    halves), then, over that score, its two-stage searches against it (replayed on halves the same way)."""
    value, n = estimated(oof)
    base = best_expected(mix_candidates(), SearchScore(), value, n)[0]
    return best_expected(staged_over(base), base, value, n)[0]


def one_pick(split: Split, oof: Scores) -> Candidate:
    """The live rule's two steps (the best one-stage score, then its best two-stage search) replayed
    on halves as one pick against dW cosine."""
    one = mix_candidates()
    value, n = estimated(oof)

    def pick(items: np.ndarray) -> SearchScore:
        base = max(one, key=lambda c: value(c, items))
        return max([base, *staged_over(base)], key=lambda c: value(c, items))

    return best_expected(one, SearchScore(), value, n, pick)[0]


RULES: dict[str, Rule] = {
    "live (MRR + nDCG@10, replayed on halves)": live,
    "both steps replayed as one pick": one_pick,
    "101 candidates at once": by_sum(("mrr", "ndcg@10"), all_at_once_candidates),
    "one stage only (no two-stage searches)": by_sum(("mrr", "ndcg@10"), mix_candidates),
    "hit@1 + MRR + nDCG@10": by_sum(MEASURES, search_candidates),
    "tiered: exact scores against dW, then all against that": tiered(),
    "lean to W2T within 1 se": leaning(1.0),
    "unseen relevant only": honest(),
    "both estimates by the unlabelled share": mixed(),
    "smoothed over the weights, cubic": smoothed(3),
    "bagged over 200 resamples, mean weight": bagged(),
    "around the one-stage pick: either stage": around(),
    "not behind dW on hit@1 and MRR out of fold": not_behind_first_hits,
    "each step guarded on its own": nested,
}


def standard_error(values: np.ndarray) -> float:
    """The standard error of the mean of per-split values (0 for one split)."""
    return float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0


def measured(
    got: np.ndarray, k: str, table: dict[Candidate, list[dict[str, float]]], fixed: dict[str, dict[str, Candidate]]
) -> dict[str, float]:
    """One study cell: measure `k` served per split (`got`), its mean, its gain over dW cosine, and its regret against
    each best fixed candidate (mean, 90th percentile, standard error)."""
    dw = np.array([r[k] for r in table[SearchScore()]])
    cell = {"score": float(got.mean()), "gain_over_dw": float(np.mean(got - dw))}
    for among, best in fixed.items():
        behind = np.array([r[k] for r in table[best[k]]]) - got
        cell[f"regret_{among}"] = float(behind.mean())
        cell[f"regret_{among}_p90"] = float(np.quantile(behind, 0.9))
        cell[f"regret_{among}_se"] = standard_error(behind)
    return cell


def cross_split_floor(table: dict[Candidate, list[dict[str, float]]], fixed: dict[str, dict[str, Candidate]]) -> dict[str, object]:
    """Not a rule a user has: on each split, per measure, the fixed candidate best served on the other splits. Its
    regret is what the noise between splits leaves to any fixed choice, so it shows how far below the goal a
    regret can be measured on these splits."""
    live = search_candidates()
    n = len(next(iter(table.values())))
    row: dict[str, object] = {"chosen": []}
    for k in MEASURES:
        got = []
        for i in range(n):
            others = [j for j in range(n) if j != i]
            best = max(live, key=lambda c: np.mean([table[c][j][k] for j in others]))
            got.append(table[best][i][k])
        row[k] = measured(np.array(got), k, table, fixed)
    return row


def one_for_all(table: dict[Candidate, list[dict[str, float]]], fixed: dict[str, dict[str, Candidate]]) -> dict[str, object]:
    """Not a rule a user has: the one fixed candidate whose largest mean regret over the three measures (against each
    measure's best fixed candidate) is least. A rule serves one search for all three measures, so where the
    measures' best candidates differ, no rule's regret can be below this one's on every measure at once."""
    best = fixed["live"]

    def worst(c: Candidate) -> float:
        return max(float(np.mean([r[k] for r in table[best[k]]]) - np.mean([r[k] for r in table[c]])) for k in MEASURES)

    pick = min(search_candidates(), key=worst)
    n = len(table[pick])
    row: dict[str, object] = {"chosen": [pick.name] * n}
    for k in MEASURES:
        row[k] = measured(np.array([r[k] for r in table[pick]]), k, table, fixed)
    return row


def load_splits(paths: list[Path]) -> list[Split]:
    """The splits of one or more dumps of the same zoo (the same adapters in the same order: e.g. seeds 0-4 and, made
    later with --seed 5, seeds 5-9), as one."""
    splits: list[Split] = []
    tasks: list[str] | None = None
    for path in paths:
        data = np.load(path)
        if tasks is not None and data["tasks"].tolist() != tasks:
            raise SystemExit(f"{path} is not a dump of the same zoo as {paths[0]}: studied as one, they must be")
        tasks = data["tasks"].tolist()
        splits += [Split.load(data, int(s)) for s in data["seeds"]]
    return splits


def study(groups: list[list[Path]]) -> dict[str, object]:
    """Each rule of RULES on each group of dumps' splits (load_splits): regret against the best fixed candidate (of
    the live ones, and of the one-stage ones alone), and gain over dW."""
    report: dict[str, object] = {}
    everything = search_candidates()
    for paths in groups:
        path = " + ".join(map(str, paths))
        splits = load_splits(paths)
        table = {c: [served(s, c) for s in splits] for c in everything}
        oofs = [out_of_fold(s, everything) for s in splits]
        fixed = {
            among: {k: max(cands, key=lambda c: np.mean([row[k] for row in table[c]])) for k in MEASURES}
            for among, cands in (("live", everything), ("one_stage", mix_candidates()))
        }
        rows = {}
        for name, rule in RULES.items():
            picks = [rule(s, oof) for s, oof in zip(splits, oofs, strict=True)]
            got = {k: np.array([table[c][i][k] for i, c in enumerate(picks)]) for k in MEASURES}
            row: dict[str, object] = {"chosen": [c.name for c in picks]}
            for k in MEASURES:
                row[k] = measured(got[k], k, table, fixed)
            rows[name] = row
        rows["floor: per measure, the best fixed candidate on the other splits (hindsight)"] = cross_split_floor(table, fixed)
        rows["floor: one fixed candidate for all three measures (hindsight)"] = one_for_all(table, fixed)
        matches = sum(s.chosen_live == c for s, c in zip(splits, rows[next(iter(RULES))]["chosen"], strict=True))  # type: ignore[call-overload]
        report[path] = {
            "fixed_oracle": {among: {k: c.name for k, c in best.items()} for among, best in fixed.items()},
            "fixed_scores": {
                among: {k: float(np.mean([r[k] for r in table[c]])) for k, c in best.items()} for among, best in fixed.items()
            },
            "dw": {k: float(np.mean([r[k] for r in table[SearchScore()]])) for k in MEASURES},
            "live_reproduced": f"{matches} of {len(splits)}",
            "rules": rows,
        }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="train W2T per split and save the scores a rule needs")
    d.add_argument("--data-dir", required=True)
    d.add_argument("--space")
    d.add_argument("--labelled-per-task", type=int, help="label-scarce split (default: full labels, 20 %% held out)")
    d.add_argument("--splits", type=int, default=5)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--epochs", type=int, default=80)
    d.add_argument("--members", type=int, help="W2T models in the ensemble (default: TrainOptions')")
    d.add_argument("--val-fraction", type=float, help="each member's held-out share (default: TrainOptions')")
    d.add_argument("--objective", default="supervised", choices=["supervised", "both"])
    d.add_argument("--augment-rescale", type=float, help="views rescale each update by e^U(-x, x) (default: TrainOptions')")
    d.add_argument("--augment-module-dropout", type=float, help="views drop up to this share of the modules (default: TrainOptions')")
    d.add_argument(
        "--augment-mixup", type=float, help="share of labelled adapters a step mixes with one of their task (default: TrainOptions')"
    )
    d.add_argument(
        "--unlabelled-per-labelled", type=float, help="both: unlabelled adapters an epoch draws per labelled one (default: TrainOptions')"
    )
    d.add_argument("--out", required=True, type=Path)
    s = sub.add_parser("study", help="replay every rule on dumps")
    s.add_argument("dumps", nargs="+", type=Path)
    s.add_argument("--join", action="store_true", help="study the dumps' splits as one (dumps of one zoo made with other --seed)")
    args = parser.parse_args()
    if args.command == "dump":
        dump(args)
        return
    report = study([args.dumps] if args.join else [[d] for d in args.dumps])
    for path, r in report.items():
        assert isinstance(r, dict)
        print(f"{path}: live rule reproduced on {r['live_reproduced']} splits; dW {r['dw']}")
        for among in ("live", "one_stage"):
            print(f"  best fixed ({among}): {r['fixed_oracle'][among]} {r['fixed_scores'][among]}")
        for name, row in r["rules"].items():
            cells = "  ".join(
                f"{k} {row[k]['score']:.3f} regret {row[k]['regret_live']:.3f} ± {row[k]['regret_live_se']:.3f}"
                f"/{row[k]['regret_one_stage']:.3f} "
                f"gain {row[k]['gain_over_dw']:+.3f}"
                for k in MEASURES
            )
            print(f"  {name:<40} {cells}  [{', '.join(row['chosen'])}]")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
