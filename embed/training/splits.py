"""A split of a zoo's adapters for `zoo eval`: held out at random (full labels), or per task a few labelled adapters and
the task's others as queries (label-scarce)."""

from __future__ import annotations

import numpy as np

from embed.data.types import ZooAdapter, split_positions
from zoo.labels import TASK_KEY


def split_of(
    adapters: list[ZooAdapter], test_fraction: float, seed: int, labelled_per_task: int | None, label_fraction: float | None
) -> tuple[list[int], list[int], list[ZooAdapter]]:
    """(train positions, test positions, the adapters W2T trains on) of one seeded split (see `evaluate`)."""
    if labelled_per_task is not None or label_fraction is not None:
        train_pos, test_pos = labelled_split(adapters, labelled_per_task, label_fraction, seed)
        held = set(test_pos)
        fit = [ZooAdapter(a.id, a.name, a.factors, {}, {}, a.source_uri) if p in held else a for p, a in enumerate(adapters)]
        return train_pos, test_pos, fit
    train_pos, test_pos = split_positions(adapters, test_fraction, seed)
    return train_pos, test_pos, [adapters[p] for p in train_pos]


def _share(fraction: float | None, size: int) -> int:
    """`fraction` of `size`, at least one."""
    if fraction is None:
        raise ValueError("give one of labelled_per_task and label_fraction")
    return max(1, int(round(fraction * size)))


def protocol(labelled_per_task: int | None, label_fraction: float | None) -> str:
    if labelled_per_task is not None:
        return f"{labelled_per_task} labelled per task"
    if label_fraction is not None:
        return f"{label_fraction:g} of each task labelled"
    return "full labels"


def labelled_split(adapters: list[ZooAdapter], per_task: int | None, fraction: float | None, seed: int) -> tuple[list[int], list[int]]:
    """(labelled, queries) positions: per task, `per_task` adapters (or `fraction` of them, at least one) drawn
    with the seed over the adapters sorted by name keep their labels; the task's others are the queries.
    Adapters without a task are in neither."""
    if (per_task is None) == (fraction is None):
        raise ValueError("give one of labelled_per_task and label_fraction")
    if per_task is not None and per_task < 1 or fraction is not None and not 0 < fraction < 1:
        raise ValueError("labelled_per_task must be at least 1 and label_fraction between 0 and 1")
    rng = np.random.default_rng(seed)
    by_task: dict[str, list[int]] = {}
    for p in sorted(range(len(adapters)), key=lambda p: (adapters[p].name, adapters[p].id)):
        if adapters[p].labels.get(TASK_KEY):
            by_task.setdefault(adapters[p].labels[TASK_KEY], []).append(p)
    labelled: list[int] = []
    queries: list[int] = []
    for task in sorted(by_task):
        members = by_task[task]
        n = per_task if per_task is not None else _share(fraction, len(members))
        chosen = set(rng.permutation(len(members))[: min(n, len(members) - 1)].tolist())  # a task keeps a query
        labelled += [members[i] for i in sorted(chosen)]
        queries += [members[i] for i in range(len(members)) if i not in chosen]
    return sorted(labelled), sorted(queries)
