"""`zoo eval --save DIR` and `zoo eval --pool DIR...`: each split's result in a file of its own, with its per-query
scores, so that splits run apart (in several processes, or again after a stop) summarize as one run does, and the
search choice's regret can be pooled over several runs (recipes, label budgets)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from embed.training.eval_summary import regret_per_query
from embed.training.evaluate import REGRET_KEYS, SplitQueries
from embed.training.intervals import clustered_bootstrap
from zoo.errors import UsageError

#: a split's file in a --save directory, by its seed
SPLIT_FILE = "split-{seed}.json"


def _arrays(scores: dict[str, dict[str, np.ndarray]]) -> dict[str, dict[str, list[float]]]:
    return {name: {k: v.tolist() for k, v in per.items()} for name, per in scores.items()}


def _numpy(scores: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, np.ndarray]]:
    return {name: {k: np.asarray(v, dtype=np.float64) for k, v in per.items()} for name, per in scores.items()}


def save_split(result: dict[str, Any], directory: Path, options: dict[str, Any]) -> Path:
    """Write one split's result (embed.training.evaluate.evaluate's, per-query scores included) and the `options` it ran with
    to DIR/split-SEED.json, through a temporary file so that a stopped run never leaves half a split."""
    directory.mkdir(parents=True, exist_ok=True)
    q: SplitQueries = result["per_query"]
    per_query = {"tasks": q.tasks, "methods": _arrays(q.methods), "candidates": _arrays(q.candidates), "served": q.served}
    path = directory / SPLIT_FILE.format(seed=result["seed"])
    part = path.with_suffix(".part")
    part.write_text(json.dumps({"options": options, "result": {**result, "per_query": per_query}}, default=str))
    part.replace(path)
    return path


def load_split(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the result as embed.training.evaluate.evaluate returned it, the options it ran with) from a file of save_split."""
    try:
        saved = json.loads(path.read_text())
        result, q = saved["result"], saved["result"]["per_query"]
        queries = SplitQueries(list(q["tasks"]), _numpy(q["methods"]), _numpy(q["candidates"]), q["served"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{path} is not a split saved by `zoo eval --save`: {exc}") from exc
    return {**result, "per_query": queries}, saved["options"]


def saved_split(directory: Path, seed: int, options: dict[str, Any]) -> dict[str, Any] | None:
    """The split of `seed` saved in `directory`, where one is (None otherwise); an error if it ran with other options."""
    path = directory / SPLIT_FILE.format(seed=seed)
    if not path.exists():
        return None
    result, ran_with = load_split(path)
    if ran_with != options:
        differ = sorted(k for k in {*ran_with, *options} if ran_with.get(k) != options.get(k))
        raise UsageError(f"{path} was run with other options ({', '.join(differ)}): save this run to another directory")
    return result


def load_run(directory: Path) -> list[dict[str, Any]]:
    """Every split saved in `directory`, by seed; an error where there is none or they ran with different options."""
    paths = sorted(directory.glob(SPLIT_FILE.format(seed="*")))
    if not paths:
        raise UsageError(f"{directory} holds no split saved by `zoo eval --save`")
    loaded = [load_split(p) for p in paths]
    if any(options != loaded[0][1] for _, options in loaded):
        raise UsageError(f"the splits in {directory} ran with different options: pool them as separate runs")
    return sorted((r for r, _ in loaded), key=lambda r: r["seed"])


def pooled_regret(runs: list[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The search choice's cross-fitted regret (embed.training.eval_summary.cross_fitted_regret) pooled over several runs: in
    each run, per split, the best fixed candidate on that run's other splits against the search served, per query;
    the mean over every query of every run, with its interval from resampling the splits (each run's its own) and the
    query tasks (one cluster per space and task, whichever runs it is in: budgets of one zoo share their tasks),
    crossed. Runs of fewer than two splits are left out. Empty without such a run."""
    kept = [(i, run) for i, run in enumerate(runs) if len(run) >= 2 and all(r["per_query"].tasks for r in run)]
    if not kept:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for key in REGRET_KEYS:
        lost, splits, tasks = [], [], []
        for i, run in kept:
            for r, d in zip(run, regret_per_query(run, key)[1], strict=True):
                lost.append(d)
                splits += [(i, r["seed"])] * len(d)
                tasks += [(r["space"], t) for t in r["per_query"].tasks]
        interval = clustered_bootstrap(np.concatenate(lost), [splits, tasks])
        out[key] = {
            "mean": interval.mean,
            "low": interval.low,
            "high": interval.high,
            "clear": interval.clear,
            "runs": len(kept),
            "splits": interval.clusters[0],
            "tasks": interval.clusters[1],
            "queries": len(splits),
        }
    return out
