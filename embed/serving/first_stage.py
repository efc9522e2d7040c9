"""A search's first stage: the candidates its indexes nominate, which its scores then rank."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from embed.serving.results import Query
from embed.serving.space_state import LoadedEmbedder


def first_stage(
    searched: Sequence[LoadedEmbedder], vectors: Mapping[str, np.ndarray], fetch: int, allowed: np.ndarray | None, query: Query
) -> np.ndarray:
    """The union of each searched index's `fetch` nearest of the query (among `allowed`), sorted, the query itself
    left out."""
    if allowed is not None and not len(allowed):
        return np.zeros(0, np.int64)
    pool: set[int] = set()
    for e in searched:
        pool.update(e.index.search(vectors[e.method][None, :], fetch, allowed=allowed)[1][0].tolist())
    pool.discard(-1)
    if query.adapter_id is not None:
        pool.discard(query.adapter_id)
    return np.array(sorted(pool), dtype=np.int64)
