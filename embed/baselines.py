"""Training-free representations to compare against (and to use with no labels at all).

- exact dW cosine: <dW_x, dW_y> summed over modules, from the canonical form;
- dW sketch: per module Ωᵀ·dW·Ψ for seeded Gaussian Ω (out × k), Ψ (in × k), computed as
  (ΩᵀU)·diag(S)·(VᵀΨ) without materializing dW, scaled so inner products are unbiased
  estimates of <dW_x, dW_y>, concatenated and normalized;
- raw factor cosine: the flattened A and B factors as stored in the files (factorization-
  dependent: the naive baseline);
- spectra: the singular values of every module, padded to a common rank.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from embed.dataset import SpaceSchema, ZooAdapter
from zoo.formats import read_adapter

SKETCH_K = 16


def dw_gram(adapters: list[ZooAdapter], schema: SpaceSchema) -> np.ndarray:
    """Exact Gram matrix <dW_i, dW_j> (summed over modules), module by module in float64."""
    n = len(adapters)
    gram = torch.zeros(n, n, dtype=torch.float64)
    for name, out, inp in schema.modules:
        flat = torch.zeros(n, out * inp, dtype=torch.float32)
        for i, a in enumerate(adapters):
            f = a.factors.get(name)
            if f is not None and f.rank:
                flat[i] = ((f.U * f.S) @ f.V.T).reshape(-1)
        gram += (flat @ flat.T).double()
    return gram.numpy()


def cosine_from_gram(gram: np.ndarray) -> np.ndarray:
    d = np.sqrt(np.clip(np.diag(gram), 1e-30, None))
    return gram / d[:, None] / d[None, :]


def _probes(name: str, out: int, inp: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = int.from_bytes(hashlib.sha256(f"sketch|{seed}|{name}|{out}|{inp}".encode()).digest()[:8], "little") >> 1
    gen = torch.Generator().manual_seed(s)
    return torch.randn(out, k, generator=gen), torch.randn(inp, k, generator=gen)


def dw_sketch(adapters: list[ZooAdapter], schema: SpaceSchema, k: int = SKETCH_K, seed: int = 0) -> np.ndarray:
    """(N, Σ_m k²) sketch embeddings, L2-normalized; missing modules are zeros."""
    blocks = []
    for name, out, inp in schema.modules:
        omega, psi = _probes(name, out, inp, k, seed)
        block = torch.zeros(len(adapters), k * k)
        for i, a in enumerate(adapters):
            f = a.factors.get(name)
            if f is not None and f.rank:
                block[i] = (((omega.T @ f.U) * f.S) @ (f.V.T @ psi)).reshape(-1) / k
        blocks.append(block)
    x = torch.cat(blocks, dim=1).numpy()
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


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
            data = read_adapter(a.source_uri)  # type: ignore[arg-type]
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
