"""aᵀb of two tall float64 factors (rows × rank), by whichever library takes it faster on this machine.

The relation detectors take thousands of such products an adapter at real widths (a Llama-3-8B module's U is 4,096 or
14,336 rows by its rank). Which BLAS is faster there depends on the CPU, not on the code: one thread, aᵀb of
14,336 × 16 factors took 0.18 ms by torch (MKL) and 0.33 by numpy (OpenBLAS) on an Intel machine, but 0.73 and 0.31 on
an AMD EPYC one, where MKL takes a slower path. So the first product of each size class is timed both ways, and the
faster library takes that class's products for the rest of the process. A product of fewer than MEASURED_FROM entries
is numpy's: its call costs less there (2,560 × 16: 0.020 against 0.022 ms; 640 × 8: 0.002 against 0.005).
"""

from __future__ import annotations

import time

import numpy as np
import torch

#: factors with fewer entries (rows × rank) than this are multiplied by numpy without a measurement
MEASURED_FROM = 1 << 16
#: times each library's product is taken when a size class is measured, the two in turn (the least time counts: a busy
#: machine only ever adds time)
REPEATS = 10

#: by size class (`size_class`): True where torch's product was the faster
_torch_faster: dict[tuple[int, int, int], bool] = {}


def cross(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """aᵀb (a: rows × r_a, b: rows × r_b), by the library faster at a's size class on this machine."""
    if a.size >= MEASURED_FROM and torch_is_faster(a.shape):
        return _by_torch(a, b)
    return _by_numpy(a, b)


def _by_torch(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (torch.from_numpy(a).T @ torch.from_numpy(b)).numpy()


def _by_numpy(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.T @ b


def size_class(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """Products timed once per class: the rows' power of two, the rank, and torch's thread count (which library is
    faster differs with threads; the relation step runs torch and numpy's BLAS on one thread each)."""
    return int(shape[0]).bit_length(), int(shape[1]), torch.get_num_threads()


def torch_is_faster(shape: tuple[int, ...]) -> bool:
    """Whether torch takes aᵀb of factors of `shape` faster than numpy here, timed at the first product of the class
    under the caller's thread limits."""
    key = size_class(shape)
    if key not in _torch_faster:
        by_torch, by_numpy = product_times(int(shape[0]), int(shape[1]), REPEATS)
        _torch_faster[key] = by_torch < by_numpy
    return _torch_faster[key]


def product_times(rows: int, rank: int, repeats: int) -> tuple[float, float]:
    """(torch's, numpy's) least seconds of `repeats` products aᵀb of two random rows × rank float64 factors, taken in
    turn after one untimed each."""
    a, b = np.random.default_rng(0).standard_normal((2, rows, rank))
    best = [float("inf"), float("inf")]
    for i in range(repeats + 1):
        for k, product in enumerate((_by_torch, _by_numpy)):
            start = time.perf_counter()
            product(a, b)
            if i:
                best[k] = min(best[k], time.perf_counter() - start)
    return best[0], best[1]
