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


class ModuleStack:
    """Many adapters' modules stacked per module name, for batched module cosines.

    Per module: the unit-norm dW flattened (N, out·in) where that is no bigger than twice the
    factors, else the factors zero-padded to the largest rank: U (N, R, out), V (N, R, in) and
    σ/|σ| (N, R). Rows of adapters without the module are zero and marked absent.
    """

    def __init__(self, adapters: Sequence[Factors]) -> None:
        self.size = len(adapters)
        self.present: dict[str, torch.Tensor] = {}
        self.dense: dict[str, torch.Tensor] = {}
        self.factors: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        names = sorted({n for a in adapters for n, f in a.items() if f.rank})
        for name in names:
            rows = [(j, a[name]) for j, a in enumerate(adapters) if name in a and a[name].rank]
            out, inp = rows[0][1].U.shape[0], rows[0][1].V.shape[0]
            rank = max(f.rank for _, f in rows)
            present = torch.zeros(self.size, dtype=torch.bool)
            present[[j for j, _ in rows]] = True
            self.present[name] = present
            if out * inp <= 2 * rank * (out + inp):
                flat = torch.zeros(self.size, out * inp)
                for j, f in rows:
                    flat[j] = ((f.U * (f.S / f.S.norm().clamp_min(1e-30))) @ f.V.T).reshape(-1)
                self.dense[name] = flat
                continue
            U, V, S = torch.zeros(self.size, rank, out), torch.zeros(self.size, rank, inp), torch.zeros(self.size, rank)
            for j, f in rows:
                U[j, : f.rank] = f.U.T
                V[j, : f.rank] = f.V.T
                S[j, : f.rank] = f.S / f.S.norm().clamp_min(1e-30)
            self.factors[name] = (U, V, S)

    def cosines(self, queries: ModuleStack, chunk: int = 64) -> np.ndarray:
        """(queries.size, self.size) mean per-module cosines over shared modules; 0 where none is shared.

        Both stacks must come from one ModuleStack (by `select`), so their layouts agree.
        """
        total = torch.zeros(queries.size, self.size, dtype=torch.float64)
        count = torch.zeros(queries.size, self.size, dtype=torch.float64)
        for name in queries.present.keys() & self.present.keys():
            both = (queries.present[name][:, None] & self.present[name][None, :]).double()
            count += both
            if (name in self.dense) != (name in queries.dense):
                raise ValueError("stacks of different layouts: select both from one ModuleStack")
            if name in self.dense:
                total += (queries.dense[name] @ self.dense[name].T).double() * both
                continue
            Ug, Vg, Sg = self.factors[name]
            Uq, Vq, Sq = queries.factors[name]
            G, R = Sg.shape
            ug, vg = Ug.reshape(G * R, -1), Vg.reshape(G * R, -1)
            for start in range(0, queries.size, chunk):
                sl = slice(start, start + chunk)
                q, r = Sq[sl].shape
                uu = (Uq[sl].reshape(q * r, -1) @ ug.T).reshape(q, r, G, R)
                vv = (Vq[sl].reshape(q * r, -1) @ vg.T).reshape(q, r, G, R)
                cos = (uu * vv * Sq[sl][:, :, None, None] * Sg[None, None]).sum(dim=(1, 3))
                total[sl] += cos.double() * both[sl]
        return (total / count.clamp_min(1)).numpy()

    def select(self, rows: Sequence[int]) -> ModuleStack:
        """The stack of a subset of its adapters (same layout per module)."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        sub = ModuleStack([])
        sub.size = len(idx)
        sub.present = {n: p[idx] for n, p in self.present.items()}
        sub.dense = {n: d[idx] for n, d in self.dense.items()}
        sub.factors = {n: (U[idx], V[idx], S[idx]) for n, (U, V, S) in self.factors.items()}
        return sub


def module_cosine_matrix(queries: Sequence[Factors], gallery: Sequence[Factors]) -> np.ndarray:
    """(len(queries), len(gallery)) mean per-module dW cosines over shared modules; 0 where none is shared."""
    stack = ModuleStack([*queries, *gallery])
    return stack.select(range(len(queries), stack.size)).cosines(stack.select(range(len(queries))))
