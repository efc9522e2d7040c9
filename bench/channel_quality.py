"""Retrieval quality of the training-free similarity channels (zoo/domain/channels.py) against dW cosine, on a zoo.

With `--per-task` labelled adapters per task (embed.training.splits.labelled_split, one draw per split), every other adapter
with a task queries the labelled ones; an item is relevant when it has the query's task. Per channel and split: the
mean hit@1, MRR and nDCG@10 over the queries (embed.selection.metrics.retrieval_per_query). Each channel's gain over dW cosine
is paired by split, with a 95 % t interval over the splits. Channels and mixes are training-free: no label is used
but to score.

    python -m bench.channel_quality --data-dir DIR [--per-task 8] [--splits 10]

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from scipy import stats

from embed.data.dataset import base_models, load_adapters
from embed.selection.metrics import retrieval_per_query
from embed.training.splits import labelled_split
from zoo.config import Settings
from zoo.domain.channels import CHANNELS, channel_matrices, factor_stack
from zoo.domain.similarity import dw_cosine_matrix
from zoo.store.blobs import BlobStore
from zoo.store.session import session_factory

MEASURES = ("hit@1", "mrr", "ndcg@10")
#: training-free mixes of two channels: the mean of their similarities
MIXES = (("module", "input_gram"), ("module", "input_subspace"), ("input_gram", "output_gram"))


def similarities(settings: Settings, space: str | None) -> tuple[dict[str, np.ndarray], list[str], float]:
    """Every channel's, every mix's and dW cosine's all-pairs matrix over the space's adapters, their tasks, seconds."""
    sessions = session_factory(settings.database_url)
    with sessions() as session:
        base = space or base_models(session)[0]
        adapters = load_adapters(session, BlobStore(settings.blob_dir), base)
    start = time.perf_counter()
    factors = [a.factors for a in adapters]
    stack = factor_stack(factors)
    sims = {name: np.asarray(m) for name, m in channel_matrices(stack, stack, CHANNELS).items()}
    sims["dw"] = dw_cosine_matrix(factors, factors)
    for a, b in MIXES:
        sims[f"{a}+{b}"] = (sims[a] + sims[b]) / 2
    return sims, [a.labels.get("task", "") for a in adapters], time.perf_counter() - start


def measure(sims: dict[str, np.ndarray], tasks: list[str], per_task: int, splits: int, seed: int) -> dict[str, object]:
    from embed.data.types import ZooAdapter

    named = [ZooAdapter(id=i, name=f"{i:06d}", factors={}, labels={"task": t} if t else {}) for i, t in enumerate(tasks)]
    per_split: dict[str, dict[str, list[float]]] = {m: {k: [] for k in MEASURES} for m in sims}
    for s in range(splits):
        labelled, queries = labelled_split(named, per_task, None, seed + s)
        gallery_tasks, query_tasks = [tasks[i] for i in labelled], [tasks[i] for i in queries]
        for method, sim in sims.items():
            found = retrieval_per_query(sim[np.ix_(queries, labelled)], query_tasks, gallery_tasks, [None] * len(queries))
            for k in MEASURES:
                per_split[method][k].append(float(found[k].mean()))
    return {method: {k: paired_gain(values[k], per_split["dw"][k]) for k in MEASURES} for method, values in per_split.items()}


def paired_gain(values: list[float], base: list[float], key: str = "gain_over_dw") -> dict[str, object]:
    """A method's mean over the splits, its mean gain over the base's (paired by split, under `key`) and the gain's
    95 % t interval."""
    v, diff = np.array(values), np.array(values) - np.array(base)
    half = float(stats.t.ppf(0.975, len(diff) - 1) * diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else float("nan")
    gain = float(diff.mean())
    return {"mean": round(float(v.mean()), 4), key: round(gain, 4), "ci95": [round(gain - half, 4), round(gain + half, 4)]}


def split_arguments(doc: str | None) -> argparse.ArgumentParser:
    """The options of a bench that measures a stored zoo on labelled splits: where the zoo is, which space, how many
    labelled per task, how many splits and from which seed."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--db", help="the database URL (default: SQLite in the data dir)")
    parser.add_argument("--space", help="the base model (default: the zoo's first)")
    parser.add_argument("--per-task", type=int, default=8)
    parser.add_argument("--splits", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main() -> None:
    args = split_arguments(__doc__).parse_args()
    sims, tasks, seconds = similarities(Settings.load(args.db, args.data_dir), args.space)
    result = measure(sims, tasks, args.per_task, args.splits, args.seed)
    print(f"{len(tasks)} adapters, {args.per_task} labelled per task, {args.splits} splits; all-pairs similarities in {seconds:.1f} s")
    print(f"{'method':<28}" + "".join(f"{k:>28}" for k in MEASURES))
    for method, row in result.items():
        print(f"{method:<28}" + "".join(_cell(row[k]) for k in MEASURES))  # type: ignore[index]
    summary = {"adapters": len(tasks), "per_task": args.per_task, "splits": args.splits, "seconds": round(seconds, 2)}
    print(json.dumps({**summary, "methods": result}))


def _cell(m: dict) -> str:
    """A measure's mean, its gain over dW cosine and the gain's interval, in 28 columns."""
    return f"{m['mean']:>8.3f} {m['gain_over_dw']:+.3f} [{m['ci95'][0]:+.3f},{m['ci95'][1]:+.3f}]"


if __name__ == "__main__":
    main()
