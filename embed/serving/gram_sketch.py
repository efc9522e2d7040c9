"""The input-Gram sketch embedder's vectors: input_gram search's first stage."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from zoo.domain.channels import channel_sketches
from zoo.domain.similarity import MODULE_SKETCH_DIM

if TYPE_CHECKING:
    from zoo.domain.canonical import CanonicalFactors


#: the most dimensions an input-Gram sketch has (half the module sketch's MAX_SEARCH_DIM: a million Llama-3-8B
#: adapters' second sketch index then takes 2 GB, not 4.5)
MAX_GRAM_DIM = 1024


def gram_sketch_width(n_modules: int) -> int:
    """Probe pairs per module of an input-Gram sketch: the module sketch's rule (`sketch_width`) under MAX_GRAM_DIM,
    MODULE_SKETCH_DIM where the modules are few, fewer where the whole vector would pass it (at least one)."""
    return max(1, min(MODULE_SKETCH_DIM, MAX_GRAM_DIM // max(n_modules, 1)))


def gram_sketches(adapters: Sequence[Mapping[str, CanonicalFactors]], modules: Sequence[str], dim: int) -> np.ndarray:
    """The adapters' input-Gram sketches (`channel_sketches`), each product on one BLAS thread (zoo/domain/module_work.py)."""
    return channel_sketches(adapters, modules, dim, "input_gram")
