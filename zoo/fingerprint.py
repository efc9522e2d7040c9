"""Hashes of canonical adapters and the numeric test that two adapters are the same update.

The canonical hash must not depend on how an update was factorized, so it is computed
from quantities that are continuous functions of dW alone, read off the canonical
components: for FINGERPRINT_DIM fixed, seeded Gaussian probes (ω_j, ψ_j) per module,
z_j = Σ_modules ω_jᵀ U diag(S) Vᵀ ψ_j, normalized by the adapter's total Frobenius norm
and rounded to HASH_DECIMALS decimals, together with the rounded log10 of that norm and
the module names and shapes. Singular vectors of nearly equal singular values can rotate
freely, so hashing U and V entry by entry would not be stable; these sketches are.

Any rounding has boundaries: a value within float noise (~1e-6 here) of a rounding
boundary can round differently in a re-factorized copy. `hash_margin` reports how close
the nearest value is; deduplication therefore does not rely on the hash alone but
confirms candidates with `relative_distance` (see DUPLICATE_RTOL).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence

import torch

from zoo.canonical import CanonicalFactors, frobenius_norm_sq
from zoo.probes import probe_values, probes

FINGERPRINT_DIM = 8
HASH_DECIMALS = 3
#: Two adapters are the same update when ||dW_x - dW_y||_F <= DUPLICATE_RTOL · max(||dW_x||, ||dW_y||).
DUPLICATE_RTOL = 1e-3

NamedFactors = Sequence[tuple[str, CanonicalFactors]]
#: (normalized probe values z, total Frobenius norm) of an adapter
Fingerprint = tuple[list[float], float]


def structure_hash(shapes: Sequence[tuple[str, int, int]]) -> str:
    """Hash of the module names and shapes only: adapters that can be compared share it."""
    payload = json.dumps(sorted([list(s) for s in shapes]), separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def fingerprint(modules: NamedFactors) -> Fingerprint:
    """(normalized probe values z, total Frobenius norm) of an adapter (modules of one shape and rank go through
    the probes together)."""
    z = torch.zeros(FINGERPRINT_DIM, dtype=torch.float64)
    groups: dict[tuple[int, int, int], list[tuple[str, CanonicalFactors]]] = {}
    for name, f in modules:
        groups.setdefault((f.U.shape[0], f.V.shape[0], f.rank), []).append((name, f))
    for (rows, cols, _), group in groups.items():
        stacked = CanonicalFactors(*(torch.stack([getattr(f, part) for _, f in group]) for part in ("U", "S", "V")))
        probe_pairs = [probes(name, rows, cols, FINGERPRINT_DIM) for name, _ in group]
        omega, psi = torch.stack([o for o, _ in probe_pairs]), torch.stack([p for _, p in probe_pairs])
        z += probe_values(stacked, omega, psi).sum(dim=0).cpu()
    norm = math.sqrt(sum(frobenius_norm_sq(f) for _, f in modules))
    values = (z / norm).tolist() if norm > 0 else [0.0] * FINGERPRINT_DIM
    return values, norm


def _hashed_values(modules: NamedFactors, fp: Fingerprint | None = None) -> list[float]:
    z, norm = fp or fingerprint(modules)
    log_norm = math.log10(norm) if norm > 0 else -math.inf
    return [*z, log_norm]


def canonical_hash(modules: NamedFactors, fp: Fingerprint | None = None) -> str:
    """SHA-256 of module structure plus the rounded fingerprint (see module docstring); `fp`: the modules'
    fingerprint, when the caller has it already."""
    shapes = [(name, f.U.shape[0], f.V.shape[0]) for name, f in modules]
    rounded = [round(v, HASH_DECIMALS) if math.isfinite(v) else str(v) for v in _hashed_values(modules, fp)]
    payload = json.dumps({"structure": structure_hash(shapes), "values": rounded}, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def hash_margin(modules: NamedFactors) -> float:
    """Distance of the hashed value nearest to a rounding boundary, in the hash's units."""
    step = 10.0**-HASH_DECIMALS
    margins = [abs((v / step) % 1.0 - 0.5) * step for v in _hashed_values(modules) if math.isfinite(v)]
    return min(margins, default=math.inf)


def _difference_norm_sq(x: CanonicalFactors, y: CanonicalFactors) -> float:
    """||dW_x - dW_y||_F² via QR of the stacked factors (no cancellation, unlike norms minus inner products)."""
    left = torch.cat([x.U.double() * x.S.double(), -y.U.double() * y.S.double()], dim=1)
    right = torch.cat([x.V.double(), y.V.double()], dim=1)
    core = torch.linalg.qr(left, mode="r")[1] @ torch.linalg.qr(right, mode="r")[1].T
    return float(core.pow(2).sum())


def relative_distance(x: NamedFactors, y: NamedFactors) -> float:
    """||dW_x - dW_y||_F / max(||dW_x||_F, ||dW_y||_F) over all modules; inf if structures differ."""
    ydict = dict(y)
    if sorted(n for n, _ in x) != sorted(ydict):
        return math.inf
    xx = yy = diff = 0.0
    for name, fx in x:
        fy = ydict[name]
        if fx.U.shape[0] != fy.U.shape[0] or fx.V.shape[0] != fy.V.shape[0]:
            return math.inf
        xx += frobenius_norm_sq(fx)
        yy += frobenius_norm_sq(fy)
        diff += _difference_norm_sq(fx, fy)
    denom = max(xx, yy)
    return math.sqrt(diff / denom) if denom > 0 else 0.0
