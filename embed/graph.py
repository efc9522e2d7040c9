"""The neighbour graph of a space, kept in the database: each adapter's top neighbours by module cosine.

A new adapter's candidates are the sketch index's RERANK_POOL nearest; they are scored by exact
module cosine, the adapter gets their top NEIGHBOURS as its row, and it enters every candidate's
row where it ranks among that candidate's top. Rows may name adapters deleted since; readers skip them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session
from tqdm import tqdm

from embed.dataset import ZooAdapter
from embed.index import AdapterIndex
from embed.similarity import ModuleStack, add_to_graph
from zoo.db.models import EmbeddingSpace, NeighbourList

#: candidates taken from the sketch index before exact scoring
RERANK_POOL = 200


def load_rows(session: Session, ids: list[int]) -> dict[int, dict[int, float]]:
    """Stored rows of these adapters (adapters without one are absent)."""
    rows: dict[int, dict[int, float]] = {}
    for start in range(0, len(ids), 500):
        for nl in session.scalars(select(NeighbourList).where(NeighbourList.adapter_id.in_(ids[start : start + 500]))):
            rows[nl.adapter_id] = {int(i): float(s) for i, s in nl.neighbours}
    return rows


def update_graph(
    session: Session,
    space: EmbeddingSpace,
    index: AdapterIndex,
    sketch: Callable[[list[ZooAdapter]], np.ndarray],
    adapters: Mapping[int, ZooAdapter],
    progress: bool = False,
) -> int:
    """Add every adapter of `adapters` that is in the index but has no row yet; returns how many."""
    stored = {nl.adapter_id: nl for nl in session.scalars(select(NeighbourList).where(NeighbourList.space_id == space.id))}
    in_index = set(index.ids().tolist())
    todo = [a for i, a in adapters.items() if i not in stored and i in in_index]
    rows = {i: {int(j): float(s) for j, s in nl.neighbours} for i, nl in stored.items()}
    changed: set[int] = set()
    order = list(adapters)
    row_of = {i: r for r, i in enumerate(order)}
    stack = ModuleStack([adapters[i].factors for i in order])
    bar = tqdm(total=len(todo), desc=f"neighbours {space.name}", unit="adapter", disable=not progress)
    for start in range(0, len(todo), 256):
        chunk = todo[start : start + 256]
        _, found = index.search(sketch(chunk), min(RERANK_POOL + 1, index.size))
        pools = [[int(i) for i in ids if i >= 0 and i != a.id and int(i) in row_of] for a, ids in zip(chunk, found, strict=True)]
        union = sorted({i for pool in pools for i in pool})
        col = {i: c for c, i in enumerate(union)}
        scores = stack.select([row_of[i] for i in union]).cosines(stack.select([row_of[a.id] for a in chunk]))
        for r, (a, pool) in enumerate(zip(chunk, pools, strict=True)):
            changed |= add_to_graph(rows, a.id, pool, scores[r, [col[i] for i in pool]])
            bar.update(1)
    bar.close()
    for i in changed:
        value = [[j, s] for j, s in sorted(rows[i].items(), key=lambda kv: -kv[1])]
        if i in stored:
            stored[i].neighbours = value
        else:
            session.add(NeighbourList(adapter_id=i, space_id=space.id, neighbours=value))
    session.flush()
    return len(todo)
