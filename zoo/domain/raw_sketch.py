"""Raw-factor sketches: an adapter's factors as its file had them, read at a few seeded entries of each module.

A factorwise merge's canonical dW is no sum of its parents' and a continuation's dW turns away from its parent's, so
the module sketches (which compare dW) may rank them far; their factors as given stay near (A barely moves in
training, a merge keeps entries of its parents' factors). The relation step's second neighbourhood searches these
(zoo/services/relations.py); the factors are the canonical ones in the gauge of their file (B = U·M, A = N·Vᵀ).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from zoo.domain.canonical import CanonicalFactors

#: dimensions of a raw-factor sketch, spread over the modules
RAW_SKETCH_DIM = 1024
#: the most entries of one module in it
RAW_MODULE_DIM = 128
#: components of B and A are drawn below this and taken modulo the adapter's rank: adapters of one rank read the same
RANK_SALT = 1 << 16


def _rows64(t: torch.Tensor, rows: np.ndarray) -> np.ndarray:
    """Rows of a float tensor as a float64 array, taken before the conversion (bfloat16 through torch: numpy has none)."""
    return t[rows].double().numpy() if str(t.dtype) == "torch.bfloat16" else t.numpy()[rows].astype(np.float64)


def raw_width(n_modules: int) -> int:
    """Sampled entries per module of a raw-factor sketch: RAW_SKETCH_DIM spread over the modules, at least 2 (one of B,
    one of A) and at most RAW_MODULE_DIM."""
    return max(2, min(RAW_MODULE_DIM, RAW_SKETCH_DIM // max(n_modules, 1)) // 2 * 2)


def raw_sketches(adapters: Sequence[Mapping[str, CanonicalFactors]], modules: Sequence[tuple[str, int, int]], width: int) -> np.ndarray:
    """(N, len(modules)·width) float32: each adapter's factors as given (canonical factors and their gauge) at `width`
    seeded entries of each module, half of B and half of A, each half scaled to unit norm (zeros where the adapter lacks
    the module or its gauge). The same entries in every adapter of one rank, so that the vectors' cosine estimates how
    much two adapters share their factors as their files had them: a factorwise merge with its parents (about √density
    of each parent's share), a continuation with its parent (A barely moves in training), where the module sketches,
    which compare dW, may rank them far (zoo/services/relations.py)."""
    half = width // 2
    out = np.zeros((len(adapters), len(modules), 2, half), dtype=np.float32)
    for m, (name, rows, cols) in enumerate(modules):
        rng = np.random.default_rng(zlib.crc32(f"{name}:{rows}x{cols}".encode()))
        b_rows, b_comp = rng.integers(rows, size=half), rng.integers(RANK_SALT, size=half)
        a_cols, a_comp = rng.integers(cols, size=half), rng.integers(RANK_SALT, size=half)
        by_rank: dict[tuple[int, int], list[tuple[int, CanonicalFactors]]] = {}  # by the gauge's shape: (rank, file's rank)
        for i, factors in enumerate(adapters):
            f = factors.get(name)
            if f is None or f.gauge is None or not f.rank or (f.U.shape[0], f.V.shape[0]) != (rows, cols):
                continue
            by_rank.setdefault(tuple(f.gauge[0].shape), []).append((i, f))  # type: ignore[arg-type]
        for (_, r), present in by_rank.items():  # the adapters of one rank at once: a few numpy products a module, not a dozen a pair
            at = [i for i, _ in present]
            U = np.stack([_rows64(f.U, b_rows) for _, f in present])  # (n, half, r)
            V = np.stack([_rows64(f.V, a_cols) for _, f in present])
            M = np.stack([f.gauge[0].double().numpy() for _, f in present])  # type: ignore[index]  # (n, r, r)
            N = np.stack([f.gauge[1].double().numpy() for _, f in present])  # type: ignore[index]
            b = (U * M[:, :, b_comp % r].transpose(0, 2, 1)).sum(axis=2)  # B[o, k] = U[o]·M[:, k]
            a = (N[:, a_comp % r, :] * V).sum(axis=2)  # A[k, c] = N[k]·V[c]
            for part, x in ((0, b), (1, a)):
                norm = np.sqrt((x * x).sum(axis=1, keepdims=True))
                out[at, m, part] = np.where(norm > 0, x / np.where(norm > 0, norm, 1.0), 0.0)
    return out.reshape(len(adapters), -1)
