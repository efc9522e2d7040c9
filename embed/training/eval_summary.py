"""What `zoo eval` reports of several splits: the splits combined, methods compared paired with a bootstrap that
resamples the splits and the queries' tasks (embed.training.intervals), and the search choice judged against the best fixed
candidate chosen cross-fitted (on the other splits)."""

from __future__ import annotations

from typing import Any

import numpy as np

from embed.selection.calibration import expected_calibration_error
from embed.training.evaluate import CONFIDENCE, INTERVAL_SCHEME, KEYS, MAIN_METRIC, QUERY_KEYS, REGRET_KEYS, TRAINING_FREE_KNN, VERSUS_KEYS
from embed.training.intervals import Interval, clustered_bootstrap
from zoo.domain.centred_gram import REFERENCED
from zoo.domain.exact_scores import EXACT_SCORES


def combine_splits(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Several splits' results (without their per-query scores) as one: per method and metric the mean (`methods`)
    and the population std (`methods_std`) over the splits where it is defined, with every split's result in `splits`."""
    methods: dict[str, dict[str, float | None]] = {}
    spread: dict[str, dict[str, float | None]] = {}
    for name in results[0]["methods"]:
        values = {k: [v for r in results if (v := r["methods"].get(name, {}).get(k)) is not None] for k in KEYS}
        methods[name] = {k: float(np.mean(v)) if v else None for k, v in values.items()}
        spread[name] = {k: float(np.std(v)) if v else None for k, v in values.items()}
    first = results[0]
    return {
        "space": first["space"],
        "protocol": first.get("protocol", "full labels"),
        "objective": first.get("objective", "supervised"),
        "n_train": first["n_train"],
        "n_test": first["n_test"],
        "seeds": [r["seed"] for r in results],
        "methods": methods,
        "methods_std": spread,
        "splits": results,
    }


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """What `zoo eval` reports of its splits (`evaluate`'s results): the one split's result or the splits combined
    (combine_splits), without the per-query scores, and from those the paired comparisons (INTERVAL_SCHEME): the
    leading method on MAIN_METRIC against the runner-up (`comparison`), the default against each exact score on
    VERSUS_KEYS (`default_versus`), the default's performance Spearman against the best training-free kNN
    (`spearman_versus_best_knn`), what the channel metrics add to the default (`metric_gain`: against the same W2T's
    choice made without them), the search choice's cross-fitted regret (`search_regret`) and the served task
    probabilities' calibration read against its chance floor (`calibration`)."""
    public = [{k: v for k, v in r.items() if k != "per_query"} for r in results]
    result = public[0] if len(public) == 1 else combine_splits(public)
    best = best_training_free_knn(results)
    return {
        **result,
        "interval_scheme": INTERVAL_SCHEME,
        "comparison": leader(results),
        "default_versus": {
            f"{e}_cosine": {k: compare(results, "default", f"{e}_cosine", k) for k in VERSUS_KEYS} for e in (*EXACT_SCORES, *REFERENCED)
        },
        "spearman_versus_best_knn": compare(results, "default", best, "perf_spearman") if best else None,
        "metric_gain": {k: compare(results, "default", "default_without_metric", k) for k in VERSUS_KEYS},
        "search_regret": cross_fitted_regret(results),
        "calibration": calibration(results),
    }


#: draws of a calibrated predictor's answers that calibration's floor is the mean over
FLOOR_DRAWS = 200


def calibration(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The served task probabilities' expected calibration error (attr_ece) read three ways, where every split kept
    the default's per-query CONFIDENCE: the mean of the splits' own (as each split reports it), the error of all their
    queries pooled, and the floor: the mean per-split error of a predictor calibrated by construction, whose answers
    are right with exactly the probability it states (FLOOR_DRAWS draws at the same probabilities, seeded). A split of
    a few hundred queries has an error above 0 by chance alone: its mean over splits is read against the floor, the
    pooled error against 0."""
    per = [r["per_query"].methods.get("default", {}) for r in results if "per_query" in r]
    if not per or len(per) != len(results) or any(CONFIDENCE not in p or "attr_acc" not in p for p in per):
        return None
    rng = np.random.default_rng(0)
    floor = [
        np.mean([expected_calibration_error(p[CONFIDENCE], rng.random(len(p[CONFIDENCE])) < p[CONFIDENCE]) for _ in range(FLOOR_DRAWS)])
        for p in per
    ]
    confidence, right = (np.concatenate([p[k] for p in per]) for k in (CONFIDENCE, "attr_acc"))
    return {
        "splits_mean": float(np.mean([r["methods"]["default"]["attr_ece"] for r in results])),
        "pooled": expected_calibration_error(confidence, right),
        "floor": float(np.mean(floor)),
        "queries": len(confidence),
        "splits": len(per),
    }


def _comparison(key: str, first: str, second: str, interval: Interval | None, mean: float, per_query: bool) -> dict[str, Any]:
    clusters = interval.clusters if interval else ()
    return {
        "metric": key,
        "first": first,
        "second": second,
        "difference": mean,
        "low": interval.low if interval else None,
        "high": interval.high if interval else None,
        "clear": bool(interval and interval.clear),
        "resampled": "splits and query tasks" if per_query else "splits",
        "splits": clusters[0] if clusters else 1,
        "tasks": clusters[1] if per_query and clusters else None,
    }


def compare(results: list[dict[str, Any]], first: str, second: str, key: str = MAIN_METRIC) -> dict[str, Any] | None:
    """`first` − `second` on `key` over `evaluate`'s results, paired: on one of QUERY_KEYS per query, the mean of the
    per-query differences of every split with its interval from resampling the splits and the query tasks (crossed);
    on another per split, the mean of the per-split differences with its interval from resampling the splits (none
    with one split). `clear` when the interval leaves out 0. None when either has no value (or no row) on some split."""
    if key in QUERY_KEYS:
        scores = [(r["per_query"], r["seed"]) for r in results]
        pairs = [(q.methods.get(first, {}).get(key), q.methods.get(second, {}).get(key)) for q, _ in scores]
        if any(a is None or b is None for a, b in pairs) or not sum(len(a) for a, _ in pairs):
            return None
        diffs = np.concatenate([a - b for a, b in pairs])
        splits = [seed for q, seed in scores for _ in q.tasks]
        both = clustered_bootstrap(diffs, [splits, [t for q, _ in scores for t in q.tasks]])
        return _comparison(key, first, second, both, both.mean, per_query=True)
    values = [(r["methods"].get(first, {}).get(key), r["methods"].get(second, {}).get(key)) for r in results]
    if any(a is None or b is None for a, b in values):
        return None
    per_split = np.array([a - b for a, b in values], dtype=float)
    interval = clustered_bootstrap(per_split, [range(len(per_split))]) if len(per_split) > 1 else None
    return _comparison(key, first, second, interval, float(per_split.mean()), per_query=False)


def leader(results: list[dict[str, Any]], key: str = MAIN_METRIC) -> dict[str, Any] | None:
    """The method with the best mean `key` over the splits against the runner-up (`compare`); None without two methods
    that have it on every split."""
    means = {
        name: float(np.mean([r["methods"][name][key] for r in results]))
        for name in results[0]["methods"]
        if all(r["methods"].get(name, {}).get(key) is not None for r in results)
    }
    ranked = sorted(means, key=lambda m: -means[m])
    first = ranked[0]
    values = {m: [r["methods"][m][key] for r in results] for m in ranked}
    same = [m for m in ranked[1:] if values[m] == values[first]]  # e.g. `default` when the search chosen is module cosine
    others = [m for m in ranked[1:] if m not in same]
    if not others:
        return None
    return {**(compare(results, first, others[0], key) or {}), "same_as_first": same}


def best_training_free_knn(results: list[dict[str, Any]]) -> str | None:
    """The row of TRAINING_FREE_KNN with the best mean performance Spearman over the splits (None without one that has
    it on every split). Picked in hindsight on the same splits, so the default is compared with a bar set high."""
    means = {
        name: float(np.mean([r["methods"][name]["perf_spearman"] for r in results]))
        for name in TRAINING_FREE_KNN
        if all(r["methods"].get(name, {}).get("perf_spearman") is not None for r in results)
    }
    return max(means, key=lambda m: means[m]) if means else None


def cross_fitted_picks(means: np.ndarray, sizes: np.ndarray) -> list[int]:
    """For each split (a row of `means`: every candidate's mean measure on the split, over its `sizes` queries) the
    candidate with the best mean over the other splits' queries (ties: the first): what a fixed choice made without
    the split would serve on it. Needs two splits or more."""
    if len(means) < 2 or len(sizes) != len(means):
        raise ValueError(f"cross-fitting needs two splits or more, each with its size: got {len(means)} and {len(sizes)} sizes")
    totals = means * sizes[:, None]
    others = [np.delete(np.arange(len(means)), s) for s in range(len(means))]  # summed without the split, not subtracted from all
    return [int(np.argmax(totals[o].sum(axis=0) / sizes[o].sum())) for o in others]


def regret_per_query(results: list[dict[str, Any]], key: str) -> tuple[list[str], list[np.ndarray]]:
    """For each split of `results` (two or more) the fixed search candidate with the best mean `key` over the other
    splits' queries (cross_fitted_picks, among the candidates every split has), and per query of the split that
    candidate's `key` minus the served search's (positive: the fixed choice would have done better)."""
    scores = [r["per_query"] for r in results]
    names = [n for n in scores[0].candidates if all(n in q.candidates for q in scores)]
    sizes = np.array([len(q.tasks) for q in scores], dtype=float)
    means = np.array([[q.candidates[n][key].mean() for n in names] for q in scores])
    picks = [names[i] for i in cross_fitted_picks(means, sizes)]
    return picks, [q.candidates[fixed][key] - q.candidates[q.served][key] for q, fixed in zip(scores, picks, strict=True)]


def cross_fitted_regret(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The served search score against the best fixed candidate chosen cross-fitted, per REGRET_KEYS: for each split
    the candidate with the best mean over the other splits' queries (cross_fitted_picks), and per query of the split
    that candidate's measure minus the served one's (positive: the fixed choice would have done better). The mean over
    every query with its interval resampling the splits and the query tasks, as `compare` (the picks held fixed).
    Empty with one split: there is no other to choose on."""
    scores = [r["per_query"] for r in results]
    if len(scores) < 2 or not all(q.tasks for q in scores):
        return {}
    out: dict[str, dict[str, Any]] = {}
    for key in REGRET_KEYS:
        picks, lost = regret_per_query(results, key)
        splits = [r["seed"] for r, q in zip(results, scores, strict=True) for _ in q.tasks]
        interval = clustered_bootstrap(np.concatenate(lost), [splits, [t for q in scores for t in q.tasks]])
        out[key] = {
            "mean": interval.mean,
            "low": interval.low,
            "high": interval.high,
            "clear": interval.clear,
            "splits": [
                {"seed": r["seed"], "fixed": fixed, "served": q.served, "regret": float(d.mean())}
                for r, q, fixed, d in zip(results, scores, picks, lost, strict=True)
            ],
        }
    return out
