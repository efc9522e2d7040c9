"""An update's size: log Σₘ‖dWₘ‖²_F over its modules, how far a run went whatever it learned (a performance kNN's
second input: zoo.domain.methods.KnnPredictor.width). Plain numpy, so a query served needs no torch."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def update_size(frobenius_norms: np.ndarray) -> np.ndarray:
    """The size of updates from their modules' Frobenius norms (the last axis): log Σₘ‖dWₘ‖²_F (−inf for an empty
    one)."""
    energy = (np.asarray(frobenius_norms, np.float64) ** 2).sum(axis=-1)
    with np.errstate(divide="ignore"):
        return np.log(energy)


def factors_size(singular_values: Iterable[object]) -> float:
    """update_size of one update from its modules' singular values (arrays or tensors; ‖dWₘ‖_F = ‖Sₘ‖), each norm held
    in float32 as a module stack holds it (zoo.domain.similarity.ModuleStack.norms), so that both give one size."""
    norms = [np.linalg.norm(np.asarray(s, np.float64)) for s in singular_values]
    return float(update_size(np.array(norms, dtype=np.float32)))
