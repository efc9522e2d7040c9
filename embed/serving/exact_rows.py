"""The final order of a search whose scores come from the input-Gram sketches' 8-bit store: the candidates near the
k-th scored again from the float32 vectors in the database.

An IVF index's 8-bit store (embed/serving/index.py) rounds a cosine by about (range / 255) / √12 in standard deviation:
3.9e-4 on Llama-3-8B's module sketches and 6.5e-4 on its input-Gram sketches, more than the median gap between the
10th and 11th nearest (1.5e-4 at 50,000, 4.2e-4 at a million). Where a space has no module store, its exact scores
are estimated from those sketches. Ordered by the store, a million Llama-3-8B adapters' dW top 10 (from the module
sketches) kept 0.962 of the float32 one, the input Gram's top 10 at 50,000 only 0.88. So for the indexes of
`EXACT_ROWS` a search scores its candidates from the store first, then reads from the database the float32 vectors of
the query and of every candidate whose score is within `MARGIN_TIES` ties (`AdapterIndex.tie`: twice the store's
error) of the k-th's, and scores the candidates again. A candidate further below cannot pass the k-th, so the top k
and their scores are the float32 vectors' (a few dozen rows a query, in one SELECT). The module sketches are not read
again: the rows cost 2–3 ms a query on a warm database, and more where its pages are on disk (a million Llama-3-8B
adapters on this machine: p99 22–60 ms against 5–6 ms without, `bench.serve`), for 0.03 of recall@10. Float16 stores
would double those indexes' memory instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from embed.serving.exact_search import normalize
from embed.serving.search_methods import GRAM
from embed.serving.space_state import LoadedEmbedder
from zoo.store.embeddings import embedding_rows
from zoo.store.session import Session

#: a candidate is read again when its score from the store is within this many ties of the k-th's: a tie is two
#: standard deviations of one cosine's rounding, so this is six, and a difference of two rounded scores (√2 of one,
#: the query's own rounding nearly shared) four of its own deviations from passing the k-th
MARGIN_TIES = 3.0
#: the indexes whose 8-bit stores' rows near the k-th are read again from the database
EXACT_ROWS = (GRAM,)


@dataclass
class ExactRows:
    """One search's reads of its lossy stores: which of the EXACT_ROWS indexes' 8-bit stores its scores read (`lossy`),
    and the database's float32 vectors that stand in for their rows once read (`rows`: kind → adapter id → vector)."""

    lossy: set[str] = field(default_factory=set)
    rows: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)
    #: each index's rows as last decoded from its store (a search scores the same candidates twice)
    decoded: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def vectors(self, e: LoadedEmbedder, ids: np.ndarray) -> np.ndarray:
        """The vectors of `ids` in `e`'s index, those read from the database in their place; notes a lossy store."""
        held = self.decoded.get(e.method)
        if held is None or not np.array_equal(held[0], ids):
            held = self.decoded[e.method] = (ids.copy(), e.index.vectors(ids))
        if e.index.store == "8-bit" and e.method in EXACT_ROWS:
            self.lossy.add(e.method)
        exact = self.rows.get(e.method)
        if not exact:
            return held[1]  # (read only by the scores)
        vectors = held[1].copy()
        for row, i in enumerate(ids.tolist()):
            if (v := exact.get(int(i))) is not None:
                vectors[row] = v
        return vectors

    def query(self, kind: str, adapter_id: int | None, stored: np.ndarray) -> np.ndarray:
        """The query's vector under `kind`: its float32 row where it was read, else `stored`."""
        exact = self.rows.get(kind, {}).get(adapter_id) if adapter_id is not None else None
        return stored if exact is None else exact


def near_kth(scores: np.ndarray, depth: int, margin: float) -> np.ndarray:
    """Positions of the scores within `margin` of the `depth`-th best (all of them when there are no more)."""
    if len(scores) <= depth:
        return np.arange(len(scores))
    kth = np.partition(-scores, depth - 1)[depth - 1]
    return np.flatnonzero(scores >= -kth - margin)


def read_exact(
    session: Session, embedders: Mapping[str, LoadedEmbedder], kinds: Iterable[str], ids: np.ndarray
) -> dict[str, dict[int, np.ndarray]]:
    """The float32 vectors the database holds of `ids` under each index kind, made unit as an index holds them, by id (a
    row deleted since the space was loaded is missing: its store's vector stays)."""
    out: dict[str, dict[int, np.ndarray]] = {}
    for kind in sorted(kinds):
        e = embedders[kind]
        found, vectors = embedding_rows(session, e.id, e.index.dim, ids)
        out[kind] = dict(zip(found.tolist(), normalize(vectors), strict=True))
    return out


def margin_of(embedders: Mapping[str, LoadedEmbedder], kinds: Iterable[str]) -> float:
    """How far below the k-th a candidate's score from these stores may be and still be read again."""
    return MARGIN_TIES * max(embedders[kind].index.tie for kind in kinds)
