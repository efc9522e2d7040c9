"""The few-label metric over channels × module groups (zoo/domain/channel_metric.py) against dW cosine, the input
Gram and the best single channel, on a zoo.

Per split (embed.training.splits.labelled_split, `--per-task` labelled adapters per task, one draw per split), one metric per
objective is fitted on the labelled adapters only, its shrink chosen by inner cross-validation among them, and every
other adapter with a task is a query:

- retrieval (the search metric): hit@1, MRR, nDCG@10 of each query against the whole gallery, every other adapter
  with a task, labelled or not (relevance: the same task), and against the labelled ones only (`/labelled`, as
  bench.channel_quality ranks);
- task accuracy (the task metric): the similarity-weighted vote of the 10 most similar labelled adapters;
- performance Spearman (the performance metric): of the similarity-weighted mean test accuracy of the 10 most similar
  labelled adapters, over the queries.

Beside it: every single channel of the bank (`dw` is the whole-update dW cosine) and `prior`, the single channel the
fit picks on the labelled adapters (its λ = ∞). `best single` is, per measure, the single channel with the best mean
in hindsight (chosen on the queries, which favours it). Gains are paired by split with a 95 % t interval
(bench.channel_quality.paired_gain).

    python -m bench.channel_metric --data-dir DIR [--per-task 8] [--splits 10]

The last line is one JSON object.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
from scipy import stats

from bench.channel_quality import paired_gain, split_arguments
from embed.data.dataset import base_models, load_adapters
from embed.data.types import ZooAdapter
from embed.selection.metrics import knn_classify, knn_regress, retrieval_per_query
from embed.training.evaluate import PERF_METRIC
from embed.training.splits import labelled_split
from zoo.config import Settings
from zoo.domain.channel_metric import BANK, OBJECTIVES, Bank, bank_matrices, fit_metric
from zoo.domain.channels import factor_stack
from zoo.store.blobs import BlobStore
from zoo.store.session import session_factory

RETRIEVAL = ("hit@1", "mrr", "ndcg@10")
MEASURES = (*RETRIEVAL, *(f"{k}/labelled" for k in RETRIEVAL), "task_acc", "perf_spearman")
#: which objective's metric each measure scores
OBJECTIVE_OF = {
    **{k: "search" for k in MEASURES if k not in ("task_acc", "perf_spearman")},
    "task_acc": "task",
    "perf_spearman": "performance",
}
#: the comparators every gain is paired against
BASES = ("dw", "input_gram", "best single", "prior")


def load(settings: Settings, space: str | None) -> tuple[list[ZooAdapter], Bank, float]:
    """The space's adapters and the bank between all of them, and the bank's seconds."""
    sessions = session_factory(settings.database_url)
    with sessions() as session:
        base = space or base_models(session)[0]
        adapters = load_adapters(session, BlobStore(settings.blob_dir), base)
    start = time.perf_counter()
    stack = factor_stack([a.factors for a in adapters])
    bank = bank_matrices(stack, stack)
    return adapters, bank, time.perf_counter() - start


def measure(adapters: list[ZooAdapter], bank: Bank, per_task: int, splits: int, seed: int) -> dict[str, Any]:
    """Per method and measure its mean over the splits and its gains over BASES; the fitted metrics' shrinks, priors
    and channel shares."""
    tasks = [a.labels.get("task", "") for a in adapters]
    perf = np.array([a.measurements.get(PERF_METRIC, np.nan) for a in adapters])
    methods = ("metric", "prior", *BANK)
    per_split: dict[str, dict[str, list[float]]] = {m: {k: [] for k in MEASURES} for m in methods}
    fits: dict[str, list[dict[str, Any]]] = {o: [] for o in OBJECTIVES}
    seconds = 0.0
    for s in range(splits):
        labelled, queries = labelled_split(adapters, per_task, None, seed + s)
        lab = np.asarray(labelled)
        start = time.perf_counter()
        metrics = {}
        for objective in OBJECTIVES:
            rows = lab if objective != "performance" else lab[np.isfinite(perf[lab])]
            targets = [tasks[i] for i in rows] if objective != "performance" else perf[rows]
            metrics[objective] = fit_metric(bank.take(rows, rows), targets, objective)
            fitted = metrics[objective]
            fits[objective].append({"prior": fitted.prior, "shrink": fitted.shrink, "shares": fitted.channel_shares()})
        seconds += time.perf_counter() - start
        gallery = np.asarray([i for i in range(len(adapters)) if tasks[i]])
        queried = bank.take(np.asarray(queries), gallery)
        for method in methods:
            for objective in OBJECTIVES:
                if method == "metric":
                    sim = metrics[objective].similarity(queried)
                else:
                    sim = queried.channel(metrics[objective].prior if method == "prior" else method)
                for k, v in _scores(sim, objective, queries, lab, gallery, tasks, perf).items():
                    per_split[method][k].append(v)
    out: dict[str, Any] = {"fit_seconds_per_split": round(seconds / splits, 2), "fits": _summary(fits)}
    best = {k: _best_channel(per_split, k) for k in MEASURES}
    out["best_single"] = best
    out["methods"] = {
        m: {
            k: {
                "mean": round(float(np.mean(v[k])), 4),
                **{f"vs {b}": paired_gain(v[k], per_split[best[k] if b == "best single" else b][k], "gain") for b in BASES},
            }
            for k in MEASURES
        }
        for m, v in per_split.items()
    }
    return out


def _best_channel(per_split: dict[str, dict[str, list[float]]], measure: str) -> str:
    """The single channel of the best mean on a measure over the splits (in hindsight)."""
    return max(BANK, key=lambda c: float(np.mean(per_split[c][measure])))


def _scores(
    sim: np.ndarray, objective: str, queries: list[int], labelled: np.ndarray, gallery: np.ndarray, tasks: list[str], perf: np.ndarray
) -> dict[str, float]:
    """The measures that one objective's similarity (queries × gallery) scores, each its mean over the queries."""
    query_tasks = [tasks[i] for i in queries]
    at = {g: c for c, g in enumerate(gallery.tolist())}
    lab_cols = np.asarray([at[i] for i in labelled.tolist()])
    to_labelled = sim[:, lab_cols]
    if objective == "search":
        out: dict[str, float] = {}
        whole = retrieval_per_query(sim, query_tasks, [tasks[i] for i in gallery], [at[q] for q in queries])
        only = retrieval_per_query(to_labelled, query_tasks, [tasks[i] for i in labelled], [None] * len(queries))
        for k in RETRIEVAL:
            out[k], out[f"{k}/labelled"] = float(whole[k].mean()), float(only[k].mean())
        return out
    if objective == "task":
        predicted = knn_classify(to_labelled, [tasks[i] for i in labelled])
        return {"task_acc": float(np.mean([p == t for p, t in zip(predicted, query_tasks, strict=True)]))}
    known = np.isfinite(perf[labelled])
    measured = np.isfinite(perf[np.asarray(queries)])
    guess = knn_regress(to_labelled[measured][:, known], perf[labelled][known])
    return {"perf_spearman": float(stats.spearmanr(guess, perf[np.asarray(queries)][measured]).statistic)}


def _summary(fits: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per objective: how often each prior and shrink was chosen, and each channel's mean share of the weights."""
    out: dict[str, Any] = {}
    for objective, rows in fits.items():
        shares: dict[str, float] = {}
        for r in rows:
            for c, v in r["shares"].items():
                shares[c] = shares.get(c, 0.0) + v / len(rows)
        out[objective] = {
            "priors": _counts(str(r["prior"]) for r in rows),
            "shrinks": _counts(str(r["shrink"]) for r in rows),
            "mean_shares": {c: round(v, 3) for c, v in shares.items() if v >= 0.0005},
        }
    return out


def _counts(values: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def main() -> None:
    args = split_arguments(__doc__).parse_args()
    adapters, bank, seconds = load(Settings.load(args.db, args.data_dir), args.space)
    result = measure(adapters, bank, args.per_task, args.splits, args.seed)
    print(
        f"{len(adapters)} adapters, {args.per_task} labelled per task, {args.splits} splits; a bank of {len(bank.atoms)} atoms "
        f"({len(bank.channels)} channels × {len(bank.groups)} module groups) in {seconds:.1f} s; "
        f"fits {result['fit_seconds_per_split']} s per split"
    )
    for objective, summary in result["fits"].items():
        print(f"{objective}: {summary}")
    methods = result["methods"]
    print(f"{'measure':<22}{'metric':>8}{'prior':>8}{'dw':>8}{'in_gram':>8}{'best':>8}" + "".join(f"{'metric − ' + b:>28}" for b in BASES))
    for k in MEASURES:
        m = methods["metric"][k]
        head = f"{k:<22}{m['mean']:>8.3f}{methods['prior'][k]['mean']:>8.3f}{methods['dw'][k]['mean']:>8.3f}"
        head += f"{methods['input_gram'][k]['mean']:>8.3f}{methods[result['best_single'][k]][k]['mean']:>8.3f}"
        print(head + "".join(_cell(m[f"vs {b}"]) for b in BASES))
    print(f"best single channel per measure (hindsight): {result['best_single']}")
    summary = {"adapters": len(adapters), "per_task": args.per_task, "splits": args.splits, "bank_seconds": round(seconds, 2)}
    print(json.dumps({**summary, **result}))


def _cell(g: dict) -> str:
    """A gain and its interval, in 28 columns."""
    return f"{g['gain']:>+12.3f} [{g['ci95'][0]:+.3f},{g['ci95'][1]:+.3f}]"


if __name__ == "__main__":
    main()
