"""Synthetic labelled zoos for a metric's kNN: tasks whose values are their own level plus a trend with update size,
a cosine similarity that carries the task, 8 labelled adapters a task in four folds, the rest queries."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embed.selection.choice import Fold
from zoo.domain.exact_scores import EXACT_SCORES


@dataclass(frozen=True)
class TaskTrends:
    sim: np.ndarray
    values: np.ndarray
    size: np.ndarray
    labelled: np.ndarray
    queries: np.ndarray
    folds: list[Fold]

    @property
    def exact(self) -> dict[str, np.ndarray]:
        """Every training-free exact score among the labelled adapters: the one similarity."""
        return {score: self.sim[np.ix_(self.labelled, self.labelled)] for score in EXACT_SCORES}


def task_trends(
    seed: int, tasks: int, per: int, levels: tuple[float, float], slope: float, spread: float, noise: float, blur: float
) -> TaskTrends:
    """`tasks` tasks of `per` adapters: values uniform in `levels` per task, plus `slope` times a size of std `spread`,
    plus `noise`; each adapter's direction its task's plus `blur` times a random one."""
    rng = np.random.default_rng(seed)
    group = np.repeat(np.arange(tasks), per)
    size = rng.normal(size=len(group)) * spread
    values = rng.uniform(*levels, tasks)[group] + slope * size + noise * rng.normal(size=len(group))
    x = rng.normal(size=(tasks, 16))[group] + blur * rng.normal(size=(len(group), 16))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    labelled = np.concatenate([np.flatnonzero(group == g)[:8] for g in range(tasks)])
    queries = np.setdiff1d(np.arange(len(group)), labelled)
    n = len(labelled)
    parts = np.array_split(rng.permutation(n), 4)
    folds = [Fold(sorted(part.tolist()), sorted(set(range(n)) - set(part.tolist())), np.eye(n)) for part in parts]
    return TaskTrends(x @ x.T, values, size, labelled, queries, folds)
