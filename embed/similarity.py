"""Similarity of adapters from their canonical forms (pure math; no I/O, no database).

- Module cosine: the mean, over the modules two adapters share, of the cosine of their per-module
  updates <dW_x, dW_y> / (|dW_x| |dW_y|). Computed from (U, S, V) in r×r blocks, never
  materializing dW. Unlike the cosine of the whole update, every shared module counts equally,
  so a large update of one module cannot drown the others, and adapters that target different
  module sets are compared on what they share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from zoo.canonical import CanonicalFactors

Factors = Mapping[str, CanonicalFactors]


def dense_modules(adapters: Sequence[Factors]) -> set[str]:
    """Modules whose flattened dW is no bigger than twice their largest factors: compared dense."""
    shapes: dict[str, tuple[int, int, int]] = {}
    for a in adapters:
        for name, f in a.items():
            if f.rank:
                _, _, r = shapes.get(name, (0, 0, 0))
                shapes[name] = (f.U.shape[0], f.V.shape[0], max(r, f.rank))
    return {n for n, (out, inp, r) in shapes.items() if out * inp <= 2 * r * (out + inp)}


class ModuleStack:
    """Many adapters' modules stacked per module name, for batched module cosines.

    Per module, either the unit-norm dW flattened (N, out·in) (`dense` modules), or every
    adapter's components side by side: U (Σr, out), V (Σr, in), σ/|σ| (Σr,) and the adapter each
    component belongs to. Stacks compared with each other must share `dense`.
    """

    def __init__(self, adapters: Sequence[Factors], dense: set[str]) -> None:
        self.size = len(adapters)
        self.present: dict[str, torch.Tensor] = {}
        self.dense: dict[str, torch.Tensor] = {}
        self.factors: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        names = sorted({n for a in adapters for n, f in a.items() if f.rank})
        for name in names:
            rows = [(j, a[name]) for j, a in enumerate(adapters) if name in a and a[name].rank]
            present = torch.zeros(self.size, dtype=torch.bool)
            present[[j for j, _ in rows]] = True
            self.present[name] = present
            unit = [f.S / f.S.norm().clamp_min(1e-30) for _, f in rows]
            if name in dense:
                flat = torch.zeros(self.size, rows[0][1].U.shape[0] * rows[0][1].V.shape[0])
                for (j, f), s in zip(rows, unit, strict=True):
                    flat[j] = ((f.U * s) @ f.V.T).reshape(-1)
                self.dense[name] = flat
            else:
                owner = torch.cat([torch.full((f.rank,), j) for j, f in rows])
                U = torch.cat([f.U for _, f in rows], dim=1).T.contiguous()
                V = torch.cat([f.V for _, f in rows], dim=1).T.contiguous()
                self.factors[name] = (U, V, torch.cat(unit), owner)

    def cosines(self, queries: ModuleStack, chunk: int = 4096) -> np.ndarray:
        """(queries.size, self.size) mean per-module cosines over shared modules; 0 where none is shared."""
        total = torch.zeros(queries.size, self.size, dtype=torch.float64)
        count = torch.zeros(queries.size, self.size, dtype=torch.float64)
        for name in queries.present.keys() & self.present.keys():
            if (name in self.dense) != (name in queries.dense):
                raise ValueError("stacks of different layouts: build both with the same `dense`")
            count += (queries.present[name][:, None] & self.present[name][None, :]).double()
            if name in self.dense:
                total += (queries.dense[name] @ self.dense[name].T).double()
                continue
            Ug, Vg, Sg, og = self.factors[name]
            Uq, Vq, Sq, oq = queries.factors[name]
            for start in range(0, len(Sq), chunk):
                sl = slice(start, start + chunk)
                terms = (Uq[sl] @ Ug.T) * (Vq[sl] @ Vg.T) * Sq[sl, None] * Sg[None, :]  # (components, components)
                per_query = torch.zeros(queries.size, len(Sg)).index_add_(0, oq[sl], terms)
                total += torch.zeros(queries.size, self.size).index_add_(1, og, per_query).double()
        return (total / count.clamp_min(1)).numpy()


def module_cosine_matrix(queries: Sequence[Factors], gallery: Sequence[Factors]) -> np.ndarray:
    """(len(queries), len(gallery)) mean per-module dW cosines over shared modules; 0 where none is shared."""
    dense = dense_modules([*queries, *gallery])
    return ModuleStack(gallery, dense).cosines(ModuleStack(queries, dense))


def hybrid_score(module_cosine: np.ndarray, w2t_cosine: np.ndarray, weight: float) -> np.ndarray:
    """(1 - weight) × module cosine + weight × the supervised W2T embedding's cosine."""
    return (1.0 - weight) * module_cosine + weight * w2t_cosine
