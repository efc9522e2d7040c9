"""Training-free representations to compare against (and to use with no labels at all).

- exact dW cosine and module cosine, and the module sketch: zoo/domain/similarity.py;
- raw factor cosine: the flattened A and B factors as stored in the files (factorization-
  dependent: the naive baseline);
- spectra: the singular values of every module, padded to a common rank.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from embed.data.types import SpaceSchema, ZooAdapter
from zoo.formats import read_adapter


def spectra_vectors(adapters: list[ZooAdapter], schema: SpaceSchema, rank: int) -> np.ndarray:
    x = np.zeros((len(adapters), len(schema.modules) * rank), dtype=np.float32)
    for i, a in enumerate(adapters):
        for m, (name, _, _) in enumerate(schema.modules):
            f = a.factors.get(name)
            if f is not None:
                k = min(rank, f.rank)
                x[i, m * rank : m * rank + k] = f.S[:k].numpy()
    return x


def raw_factor_vectors(adapters: list[ZooAdapter], schema: SpaceSchema, rank: int) -> np.ndarray | None:
    """Flattened stored factors (A and B, zero-padded to `rank`), read back from the source files;
    None when a source is no longer on disk."""
    rows = []
    for a in adapters:
        try:
            data = read_adapter(Path(a.source_uri))
        except Exception:
            return None
        mods = {m.name: m for m in data.modules}
        parts = []
        for name, out, inp in schema.modules:
            A = torch.zeros(rank, inp)
            B = torch.zeros(out, rank)
            m = mods.get(name)
            if m is not None:
                k = min(rank, m.rank)
                A[:k] = m.A[:k].float()
                B[:, :k] = m.B[:, :k].float() * m.scale
            parts += [A.reshape(-1), B.reshape(-1)]
        rows.append(torch.cat(parts))
    return torch.stack(rows).numpy()
