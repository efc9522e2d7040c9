"""The SVDs of a module store's dense modules, each row factored once (the engine's exact stage, embed/serving/engine.py).

A module the store keeps dense (its unit-norm dW) is compared as factors by every channel but module cosine: the input
Gram that search may serve, and a channel metric's Gram, subspace and spectrum atoms (zoo/domain/channels.py
`module_factors`). Factoring the candidates' dense modules again for every query cost 5-6 s a query on 300
digits-vit-seeded adapters, far more than the comparison itself. `DenseSVD` keeps, per store, each row's factors
(zoo.domain.channels.dense_svd) once a query's candidates first include it, and hands them out with the rows
(`take`); numpy factors each matrix on its own, so what it serves is what factoring those rows afresh gives.

It belongs to one module store's stack, and is bounded by it: at most `bound(stack)` bytes, the SVD of every row.
The engine's store is never changed in place: adding adapters or dropping deleted ones makes a new stack, whose
cache (`moved`) carries the rows that stay, each to its new position, and starts the new rows unfactored, so a
deleted or re-embedded adapter's factors cannot be served for another.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from zoo.domain.channels import DENSE_CUTOFF, dense_svd
from zoo.domain.similarity import ModuleStack


class DenseSVD:
    """Per dense module of `stack`, the SVD of each row computed the first time it is asked for (thread-safe)."""

    def __init__(self, stack: ModuleStack) -> None:
        self.stack = stack
        self._lock = threading.Lock()
        self._done = np.zeros(stack.size, dtype=bool)  # rows whose dense modules are all factored
        self._held: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # per module: U, V, S of every row

    def take(self, rows: Sequence[int] | np.ndarray) -> ModuleStack:
        """`stack.take(rows)` with the SVD of its dense modules (`ModuleStack.svd`); rows not factored yet are first."""
        idx = np.asarray(rows, dtype=np.int64)
        taken = self.stack.take(idx)
        if not self.stack.dense or not len(idx):
            return taken
        with self._lock:
            todo = np.unique(idx[~self._done[idx]])
            if len(todo):
                self._factor(todo)
            taken.svd = {name: (U[idx], V[idx], S[idx]) for name, (U, V, S) in self._held.items()}
        return taken

    def _factor(self, todo: np.ndarray) -> None:
        """Factor these rows' dense modules and hold each module's components up to the widest kept (`module_factors`:
        the others are round-off in every row, and zeroed there). A module whose new rows keep more components than
        it holds is factored again for every row held, so that each row always holds its own leading components."""
        for name, dense in self.stack.dense.items():
            U, V, S = dense_svd(dense[todo])
            width = _kept(S)
            held = self._held.get(name)
            if held is not None and width > held[2].shape[1]:
                redo = np.flatnonzero(self._done)
                U_, V_, S_ = dense_svd(dense[redo])
                held = _empty(self.stack.size, (U_[:, :width], V_[:, :width], S_[:, :width]))
                held[0][redo], held[1][redo], held[2][redo] = U_[:, :width], V_[:, :width], S_[:, :width]
            elif held is not None:
                width = held[2].shape[1]
            else:
                held = _empty(self.stack.size, (U[:, :width], V[:, :width], S[:, :width]))
            held[0][todo], held[1][todo], held[2][todo] = U[:, :width], V[:, :width], S[:, :width]
            self._held[name] = held
        self._done[todo] = True

    def factored(self) -> int:
        """How many rows are factored."""
        return int(self._done.sum())

    def moved(self, stack: ModuleStack, source: np.ndarray) -> DenseSVD:
        """The cache of `stack`, whose row j is this stack's row source[j] (-1: a row new to it, not factored yet)."""
        out = DenseSVD(stack)
        source = np.asarray(source, dtype=np.int64)
        if len(source) != stack.size:
            raise ValueError(f"a cache of {stack.size} rows needs a source row for each, not {len(source)}")
        with self._lock:
            kept = np.flatnonzero(source >= 0)
            carried = kept[self._done[source[kept]]]
            if not len(carried) or set(stack.dense) != set(self.stack.dense):
                return out
            for name, (U, V, S) in self._held.items():
                fresh = _empty(stack.size, (U, V, S))
                for a, b in zip(fresh, (U, V, S), strict=True):
                    a[carried] = b[source[carried]]
                out._held[name] = fresh
            out._done[carried] = True
        return out

    @staticmethod
    def bound(stack: ModuleStack) -> int:
        """Bytes the cache of `stack` holds at most: every row's U, V and S of every dense module, every component (it
        holds those some row keeps: about the largest rank)."""
        total = 0
        for dense in stack.dense.values():
            n, out, inp = dense.shape
            total += n * min(out, inp) * (out + inp + 1) * dense.dtype.itemsize
        return total


def _empty(rows: int, like: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Zero arrays of `rows` rows shaped and typed as each of `like`'s rows."""
    U, V, S = (np.zeros((rows, *a.shape[1:]), a.dtype) for a in like)
    return U, V, S


def _kept(S: np.ndarray) -> int:
    """How many leading components some row keeps (above DENSE_CUTOFF), at least one: what `module_factors` keeps."""
    return max(1, int((S > DENSE_CUTOFF).any(axis=0).sum()))
