"""An update's size: log Σₘ‖dWₘ‖²_F over its modules, how far a run went whatever it learned (a performance kNN's
second input: zoo.domain.methods.KnnPredictor.width), and its profile: the size with how its modules' spectra lie
(what a performance kNN's trend reads: KnnPredictor.trend). Plain numpy, so a query served needs no torch."""

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


#: what an update's profile (update_profile) holds, in order: its size; over its non-empty modules the mean of log ‖dWₘ‖²_F,
#: of log stable rank (‖Sₘ‖² / s₁²: how many directions share the update) and of log s₁ (its leading singular value);
#: and the log of how many modules it has. Within one task a run that went further, read more data or wrote more
#: directions scores otherwise; the size alone says only the first.
PROFILE = ("size", "module energy", "stable rank", "leading value", "modules")


def update_profile(singular_values: Iterable[object]) -> np.ndarray:
    """An update's profile (PROFILE, float64) from its modules' singular values (arrays or tensors, each sorted
    descending); its size is factors_size's. With no non-empty module: the size −inf and the rest NaN."""
    spectra = [np.asarray(s, np.float64) for s in singular_values]
    size = factors_size(spectra)
    kept = [s for s in spectra if len(s) and s[0] > 0]
    if not kept:
        return np.array([size, *([np.nan] * (len(PROFILE) - 1))])
    energy = np.array([float(s @ s) for s in kept])
    leading = np.array([float(s[0]) for s in kept])
    return np.array([size, np.log(energy).mean(), np.log(energy / leading**2).mean(), np.log(leading).mean(), np.log(len(kept))])
