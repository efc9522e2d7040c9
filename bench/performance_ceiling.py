"""How well held-out test accuracy can be ranked from few labels at all: predictors that are told what no weight-space
method is (each adapter's true task and its training hyperparameters), on the splits `zoo eval` uses.

A reference zoo's labels.csv (zoo make-zoo) holds every adapter's task, hyperparameters (rank, alpha, learning rate,
steps, training examples, target modules) and test accuracy. Per split (embed.training.splits.labelled_split with
`--per-task` labelled adapters per task, seeds SEED, SEED+1, ...), each oracle is fitted on the labelled adapters and
ranks the queries' accuracy (Spearman):

- `task mean`: the mean accuracy of the query's task's labelled adapters;
- `task + hyperparameters, linear`: ridge regression on the task (one-hot), the log of each numeric hyperparameter
  and the target modules (one-hot);
- `task + hyperparameters, boosted trees`: gradient-boosted trees on the same inputs.

Run noise (each adapter's own seeds) bounds them all. With 95 % t intervals over the splits; the last line is JSON.

    python -m bench.performance_ceiling ZOO_DIR [--per-task 8] [--splits 10] [--seed 0]
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

import numpy as np
from scipy import stats

from embed.data.types import ZooAdapter
from embed.training.splits import labelled_split
from zoo.labels import TASK_KEY

NUMERIC = ("rank", "alpha", "learning_rate", "steps", "n_train")
ACCURACY = "test_accuracy"


def oracle_inputs(rows: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
    """(the task one-hot, the task one-hot with the log numeric hyperparameters and the target modules one-hot)."""
    tasks = sorted({r[TASK_KEY] for r in rows})
    targets = sorted({r["target_modules"] for r in rows})
    task = np.array([[r[TASK_KEY] == t for t in tasks] for r in rows], np.float64)
    numeric = np.log(np.array([[float(r[k]) for k in NUMERIC] for r in rows]))
    target = np.array([[r["target_modules"] == t for t in targets] for r in rows], np.float64)
    return task, np.column_stack([task, numeric, target])


def ranked(rows: list[dict[str, str]], per_task: int, seeds: range) -> dict[str, list[float]]:
    """Each oracle's Spearman on each split."""
    from sklearn.ensemble import GradientBoostingRegressor
    from sklearn.linear_model import Ridge

    adapters = [ZooAdapter(i, r["name"], {}, {TASK_KEY: r[TASK_KEY]}) for i, r in enumerate(rows)]
    accuracy = np.array([float(r[ACCURACY]) for r in rows])
    task, full = oracle_inputs(rows)
    out: dict[str, list[float]] = {"task mean": [], "task + hyperparameters, linear": [], "task + hyperparameters, boosted trees": []}
    for seed in seeds:
        labelled, queries = labelled_split(adapters, per_task, None, seed)
        y = accuracy[labelled]
        means = (task[queries] @ (task[labelled].T @ y)) / np.maximum(task[queries] @ task[labelled].sum(axis=0), 1)
        linear = Ridge(alpha=1e-2).fit(full[labelled], y).predict(full[queries])
        trees = GradientBoostingRegressor(n_estimators=200, max_depth=3, learning_rate=0.05, subsample=0.8, random_state=seed)
        boosted = trees.fit(full[labelled], y).predict(full[queries])
        for name, guess in zip(out, (means, linear, boosted), strict=True):
            out[name].append(float(stats.spearmanr(guess, accuracy[queries]).statistic))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("zoo", type=Path, help="a reference zoo's directory (zoo make-zoo OUT_DIR), with its labels.csv")
    parser.add_argument("--per-task", type=int, default=8)
    parser.add_argument("--splits", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with (args.zoo / "labels.csv").open(newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get(TASK_KEY) and r.get(ACCURACY)]
    per_split = ranked(rows, args.per_task, range(args.seed, args.seed + args.splits))
    summary = {}
    for name, values in per_split.items():
        v = np.array(values)
        half = float(stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else float("nan")
        summary[name] = {"spearman": float(v.mean()), "low": float(v.mean() - half), "high": float(v.mean() + half), "splits": values}
        print(f"{name:40s} {v.mean():.3f} [{v.mean() - half:.3f}, {v.mean() + half:.3f}]")
    print(json.dumps({"zoo": str(args.zoo), "per_task": args.per_task, "oracles": summary}))


if __name__ == "__main__":
    main()
