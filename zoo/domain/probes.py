"""Seeded Gaussian probes and the bilinear sketches ωᵀ·dW·ψ they give, read off the canonical form.

One implementation for every sketch in the project: the canonical hash's fingerprint and the
module sketches the search engine ranks by. A probe pair (ω_j, ψ_j) is drawn from a generator
seeded by the module's name and shape (and an optional salt), so every process draws the same
probes; z_j = Σ_i σ_i (ω_jᵀu_i)(ψ_jᵀv_i) never materializes dW. Pure torch, no I/O.

Drawing a module's probes costs more than using them at LLM widths (Ω and Ψ of a 14,336-wide module are
~10⁵ Gaussians each), so drawn probes are kept in a cache bounded by bytes (ZOO_PROBE_CACHE_BYTES, default
512 MiB: every probe of a Llama-3-8B adapter's fingerprint and module sketch), least recently used first out.
"""

from __future__ import annotations

import functools
import hashlib
import threading

import torch
from cachetools import LRUCache, cached
from cachetools.keys import hashkey

from zoo import config
from zoo.domain.canonical import CanonicalFactors


def draw_probes(name: str, rows: int, cols: int, count: int, salt: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(Ω (rows × count), Ψ (cols × count)) float64, the same in every process."""
    key = f"{name}|{rows}|{cols}" + (f"|{salt}" if salt else "")
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1
    gen = torch.Generator().manual_seed(seed)
    omega = torch.randn(rows, count, generator=gen, dtype=torch.float64)
    psi = torch.randn(cols, count, generator=gen, dtype=torch.float64)
    return omega, psi


def _probe_bytes(pair: tuple[torch.Tensor, torch.Tensor]) -> int:
    return pair[0].nbytes + pair[1].nbytes


def _sketch_probes(name: str, rows: int, cols: int, count: int, salt: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(Ωᵀ (count × rows), Ψᵀ (count × cols)) float32, contiguous: `draw_probes` rounded, as the sketches take their
    float32 products with them (half the float64 draw's bytes in the cache, and no conversion at each use)."""
    omega, psi = draw_probes(name, rows, cols, count, salt)
    return omega.float().T.contiguous(), psi.float().T.contiguous()


_CACHE: LRUCache = LRUCache(maxsize=config.PROBE_CACHE_BYTES.get(), getsizeof=_probe_bytes)
_LOCK = threading.Lock()

#: `draw_probes` through the cache, shared by the threads of a process (the tensors are shared: do not modify them);
#: `probes.cache_clear()` empties it (both kinds)
probes = cached(_CACHE, lock=_LOCK)(draw_probes)
#: `_sketch_probes` through the same cache (keyed apart from `probes`)
sketch_probes = cached(_CACHE, key=functools.partial(hashkey, "float32"), lock=_LOCK)(_sketch_probes)


def probe_values(f: CanonicalFactors, omega: torch.Tensor, psi: torch.Tensor) -> torch.Tensor:
    """z_j = ω_jᵀ·U·diag(S)·Vᵀ·ψ_j for every probe pair j, in float64 on the factors' device. Factors and probes
    may also be stacks of n modules of one shape and rank (U n×out×k, S n×k, V n×in×k, Ω n×out×count,
    Ψ n×in×count): then n×count values, one row per module."""
    left = omega.to(f.U.device).transpose(-1, -2) @ f.U.double()  # (count, k)
    right = psi.to(f.V.device).transpose(-1, -2) @ f.V.double()  # (count, k)
    return ((left * f.S.double().unsqueeze(-2)) * right).sum(dim=-1)
