"""Similarity of adapters from their canonical forms (pure math; no I/O, no database).

- Module cosine: the mean, over the modules two adapters share, of the cosine of their per-module
  updates <dW_x, dW_y> / (|dW_x| |dW_y|). Computed from (U, S, V) in r×r blocks, never
  materializing dW. Unlike the cosine of the whole update, every shared module counts equally,
  so a large update of one module cannot drown the others, and adapters that target different
  module sets are compared on what they share.
- Contextual score: module cosine plus CONTEXT_WEIGHT × the cosine of the two adapters'
  neighbourhoods (their top-NEIGHBOURS module-cosine rows, each with itself at 1). Two adapters
  that rarely share modules (one adapting attention, one the MLP) but share neighbours (adapters
  of all modules on the same task) are drawn together: a second-order similarity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from zoo.canonical import CanonicalFactors

Factors = Mapping[str, CanonicalFactors]
NeighbourRow = Mapping[int, float]

#: neighbours kept per adapter in the neighbour graph and per query
NEIGHBOURS = 20
#: weight of the neighbourhood cosine against the module cosine
CONTEXT_WEIGHT = 0.5


def _padded(factors: list[CanonicalFactors], rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked U (n, out, rank), V (n, in, rank) and unit-norm S (n, rank), zero-padded."""
    U = torch.zeros(len(factors), factors[0].U.shape[0], rank)
    V = torch.zeros(len(factors), factors[0].V.shape[0], rank)
    S = torch.zeros(len(factors), rank)
    for j, f in enumerate(factors):
        U[j, :, : f.rank] = f.U
        V[j, :, : f.rank] = f.V
        S[j, : f.rank] = f.S / f.S.norm().clamp_min(1e-30)
    return U, V, S


def module_cosine_matrix(queries: Sequence[Factors], gallery: Sequence[Factors], chunk: int = 32) -> np.ndarray:
    """(len(queries), len(gallery)) mean per-module dW cosines over shared modules; 0 where none is shared."""
    total = torch.zeros(len(queries), len(gallery), dtype=torch.float64)
    count = torch.zeros(len(queries), len(gallery), dtype=torch.float64)
    names = sorted({n for q in queries for n, f in q.items() if f.rank})
    for name in names:
        q_rows = [i for i, q in enumerate(queries) if name in q and q[name].rank]
        g_rows = [j for j, g in enumerate(gallery) if name in g and g[name].rank]
        if not g_rows:
            continue
        g_factors = [gallery[j][name] for j in g_rows]
        Ug, Vg, Sg = _padded(g_factors, max(f.rank for f in g_factors))
        for start in range(0, len(q_rows), chunk):
            rows = q_rows[start : start + chunk]
            q_factors = [queries[i][name] for i in rows]
            Uq, Vq, Sq = _padded(q_factors, max(f.rank for f in q_factors))
            uu = torch.einsum("aor,gos->agrs", Uq, Ug)
            vv = torch.einsum("air,gis->agrs", Vq, Vg)
            cos = (uu * vv * Sq[:, None, :, None] * Sg[None, :, None, :]).sum(dim=(2, 3)).double()
            idx = torch.tensor(rows)[:, None], torch.tensor(g_rows)[None, :]
            total[idx] += cos
            count[idx] += 1
    return (total / count.clamp_min(1)).numpy()


def neighbour_row(ids: Sequence[int], scores: np.ndarray, k: int = NEIGHBOURS) -> dict[int, float]:
    """The k best-scoring ids (positive scores only) as a sparse row."""
    order = np.argsort(-scores, kind="stable")[:k]
    return {int(ids[j]): float(scores[j]) for j in order if scores[j] > 0}


def add_to_graph(
    rows: dict[int, dict[int, float]], new_id: int, candidate_ids: Sequence[int], scores: np.ndarray, k: int = NEIGHBOURS
) -> set[int]:
    """Give `new_id` its row from its scored candidates, and enter it into each candidate's row
    (present in `rows`) where it ranks among that candidate's top k. Returns the ids whose rows changed.
    """
    rows[new_id] = neighbour_row(candidate_ids, scores, k)
    changed = {new_id}
    for cid, score in zip(candidate_ids, scores, strict=True):
        row = rows.get(int(cid))
        if row is None or score <= 0 or new_id in row:
            continue
        if len(row) < k or score > min(row.values()):
            row[new_id] = float(score)
            if len(row) > k:
                del row[min(row, key=row.__getitem__)]
            changed.add(int(cid))
    return changed


def _sparse_cosine(a: NeighbourRow, b: NeighbourRow) -> float:
    if len(a) > len(b):
        a, b = b, a
    dot = sum(v * b[i] for i, v in a.items() if i in b)
    norm = math.sqrt(sum(v * v for v in a.values()) * sum(v * v for v in b.values()))
    return dot / norm if norm > 0 else 0.0


def contextual_scores(
    query_id: int | None,
    candidate_ids: Sequence[int],
    first: np.ndarray,
    candidate_rows: Sequence[NeighbourRow],
    weight: float = CONTEXT_WEIGHT,
    k: int = NEIGHBOURS,
) -> np.ndarray:
    """Module cosine `first` (query vs candidates) plus `weight` × neighbourhood cosine.

    The query's neighbourhood is its top-k candidates by `first`; each candidate's is its stored
    row plus itself. The query's own id (a stored query) is dropped from the candidates' rows.
    """
    query_row = neighbour_row(candidate_ids, first, k)
    out = np.array(first, dtype=np.float64)
    for j, (cid, row) in enumerate(zip(candidate_ids, candidate_rows, strict=True)):
        own = {i: s for i, s in row.items() if i != query_id}
        own[int(cid)] = 1.0
        out[j] += weight * _sparse_cosine(query_row, own)
    return out
