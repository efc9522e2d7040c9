"""Benchmark: retrieval metrics by counted ranks (embed.selection.metrics.retrieval_per_query) vs sorting each row whole (the
baseline, measured in the same run), and what that makes of the search choice (embed.selection.search_choice.choose_search: the
candidates it weighs scored out of fold) at a zoo's count of labelled adapters.

Synthetic scores: n labelled adapters of 20 tasks, five members each holding out a fifth. CPU seconds per call
(process time, so a busy machine does not inflate it). Prints a table and, on the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np

from embed.selection.choice import Fold
from embed.selection.metrics import retrieval_per_query
from embed.selection.search_choice import choose_search, search_candidates
from zoo.domain.exact_scores import EXACT_SCORES


def sorted_retrieval(sim: np.ndarray, query_labels: list[str], gallery_labels: list[str], self_index: list[int | None]) -> dict:
    """The baseline, and the definition: each row's gallery sorted whole (stable: ties in gallery order), the query's
    own column left out; hit@1, hit@10, MRR and nDCG@10 per query (0 where nothing is relevant)."""
    out: dict[str, list[float]] = {k: [] for k in ("hit@1", "hit@10", "mrr", "ndcg@10")}
    discounts = 1.0 / np.log2(np.arange(2, 12))
    labels = np.asarray(gallery_labels)
    for q, row in enumerate(sim):
        order = np.argsort(-row, kind="stable")
        if self_index[q] is not None:
            order = order[order != self_index[q]]
        rel = (labels[order] == query_labels[q]).astype(np.float64)
        if not rel.sum():
            for k in out:
                out[k].append(0.0)
            continue
        first = int(np.argmax(rel))
        out["hit@1"].append(float(first == 0))
        out["hit@10"].append(float(first < 10))
        out["mrr"].append(1 / (first + 1))
        out["ndcg@10"].append(float((rel[:10] * discounts[: len(rel[:10])]).sum() / discounts[: min(10, int(rel.sum()))].sum()))
    return out


def cpu_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median process time of `repeats` calls."""
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return float(np.median(times))


def measure(n: int, rng: np.random.Generator, repeats: int) -> dict[str, float]:
    """Both metrics' CPU seconds and choose_search's at n labelled adapters; prints a row of the table."""
    tasks = [f"t{i % 20}" for i in range(n)]
    sim = rng.standard_normal((n, n))
    own: list[int | None] = list(range(n))
    baseline = cpu_seconds(lambda: sorted_retrieval(sim, tasks, tasks, own), repeats)
    counted = cpu_seconds(lambda: retrieval_per_query(sim, tasks, tasks, own), repeats)
    z = rng.standard_normal((n, 64))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    exact = {score: rng.uniform(-1, 1, (n, n)) for score in EXACT_SCORES}
    perm = rng.permutation(n)
    folds = [Fold(sorted(perm[m::5].tolist()), sorted(set(range(n)) - set(perm[m::5].tolist())), z) for m in range(5)]
    made = []
    choice = cpu_seconds(lambda: made.append(choose_search(exact, tasks, folds)), 1)
    weighed = len(made[0].scores)
    print(f"{n:>8}  {baseline:>12.3f}  {counted:>9.3f}  {baseline / counted:>7.1f}x  {choice:>15.1f}  {weighed:>8}")
    return {
        "whole_sort_s": baseline,
        "counted_s": counted,
        "speedup": baseline / counted,
        "choose_search_s": choice,
        "candidates_weighed": weighed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[500, 2000])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    out: dict[str, object] = {"candidates": len(search_candidates())}
    print(f"{'labelled':>8}  {'whole sort s':>12}  {'counted s':>9}  {'speed-up':>8}  {'choose_search s':>15}  {'weighed':>8}")
    for n in args.sizes:
        out[str(n)] = measure(n, rng, args.repeats)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
