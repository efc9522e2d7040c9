"""The search channel metric fused with dW query by query (zoo/domain/fusion.py) against each alone, on a zoo.

Per split (embed.training.splits.labelled_split, `--per-task` labelled adapters per task), the search metric is fitted
on the labelled adapters only (zoo.domain.channel_metric.fit_metric, as bench.channel_metric fits it), and every other
adapter with a task queries the whole gallery (every other adapter with a task; relevance: the same task). Ranked by:
dW cosine, the input Gram, the metric, the fusion (`fused:search`: each query's scores standardized over its scores
against the labelled adapters, itself left out), and the metric with its top 5 or 10 re-ordered by the fusion: the
served functions (fused_among, SearchScore.ranking), without W2T. Every difference is paired per query, its 95 %
interval from the bootstrap clustered by split and by the query's task that `zoo eval` uses
(embed/training/intervals.py).

    python -m bench.fusion --data-dir DIR [--per-task 8] [--splits 10]

The last line is one JSON object.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from bench.channel_metric import load
from bench.channel_quality import split_arguments
from embed.selection.fitted import with_fused
from embed.selection.metrics import retrieval_per_query
from embed.training.intervals import clustered_bootstrap
from embed.training.splits import labelled_split
from zoo.config import Settings
from zoo.domain.channel_metric import fit_metric
from zoo.domain.methods import SearchScore, fitted_score, fused_score

MEASURES = ("hit@1", "mrr", "ndcg@10")
METRIC, FUSED = fitted_score("search"), fused_score("search")
#: the searches compared, by the names `zoo train` gives them
SEARCHES = (
    SearchScore("dw"),
    SearchScore("input_gram"),
    SearchScore(METRIC),
    SearchScore(FUSED),
    SearchScore(METRIC, 0.0, 0.0, 5, FUSED),
    SearchScore(METRIC, 0.0, 0.0, 10, FUSED),
)
#: the searches every other is paired against
BASES = ("dw", METRIC)


def measure(settings: Settings, space: str | None, per_task: int, splits: int, seed: int) -> dict[str, Any]:
    """Per search and measure its mean over every split's queries, and its paired difference from each of BASES."""
    adapters, bank, _ = load(settings, space)
    tasks = [a.labels.get("task", "") for a in adapters]
    gallery = np.array([i for i, t in enumerate(tasks) if t])
    at = {int(g): c for c, g in enumerate(gallery)}
    per: dict[str, dict[str, list[np.ndarray]]] = {s.name: {k: [] for k in MEASURES} for s in SEARCHES}
    split_of: list[int] = []
    task_of: list[str] = []
    for s in range(splits):
        labelled, queries = labelled_split(adapters, per_task, None, seed + s)
        queries = [q for q in queries if tasks[q]]
        metric = fit_metric(bank.take(np.asarray(labelled), np.asarray(labelled)), [tasks[i] for i in labelled], "search")
        among = bank.take(gallery, gallery)  # gallery × gallery: the square with_fused standardizes over its labelled columns
        exact = with_fused(
            {"dw": among.channel("dw"), "input_gram": among.channel("input_gram"), METRIC: metric.similarity(among)},
            [at[i] for i in labelled],
        )
        rows = [at[q] for q in queries]
        own = np.zeros((len(rows), len(gallery)), bool)
        own[np.arange(len(rows)), rows] = True
        for search in SEARCHES:
            second = None if search.rerank_exact is None else exact[search.rerank_exact][rows]
            keys = search.ranking(exact[search.exact][rows], np.zeros(own.shape), own, second)
            found = retrieval_per_query(keys, [tasks[q] for q in queries], [tasks[i] for i in gallery], rows)
            for k in MEASURES:
                per[search.name][k].append(found[k])
        split_of += [s] * len(queries)
        task_of += [tasks[q] for q in queries]
    out: dict[str, Any] = {"adapters": len(adapters), "queries": len(split_of), "searches": {}}
    for name, values in per.items():
        row: dict[str, Any] = {}
        for k in MEASURES:
            v = np.concatenate(values[k])
            row[k] = {"mean": round(float(v.mean()), 4)}
            for base in BASES:
                if base != name:
                    iv = clustered_bootstrap(v - np.concatenate(per[base][k]), [split_of, task_of])
                    row[k][f"- {base}"] = [round(iv.mean, 4), round(iv.low, 4), round(iv.high, 4)]
        out["searches"][name] = row
    return out


def main() -> None:
    args = split_arguments(__doc__).parse_args()
    result = measure(Settings.load(args.db, args.data_dir), args.space, args.per_task, args.splits, args.seed)
    print(f"{result['adapters']} adapters, {args.per_task} labelled per task, {args.splits} splits, {result['queries']} queries")
    for name, row in result["searches"].items():
        cells = []
        for k in MEASURES:
            diffs = " ".join(f"{b}: {d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}]" for b, d in ((b[2:], row[k][b]) for b in row[k] if b != "mean"))
            cells.append(f"{k} {row[k]['mean']:.3f} ({diffs})")
        print(f"{name}\n  " + "\n  ".join(cells))
    print(json.dumps({"per_task": args.per_task, "splits": args.splits, **result}))


if __name__ == "__main__":
    main()
