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

That confirmation reads a stored candidate's factors, as large as the adapter's file (hundreds of
MB for an LLM), so candidates are first screened by their raw probe values z_j·||dW|| (`Sketch.raw`,
stored per adapter): z_j is linear in dW, so for updates x and y of one structure (same module names
and shapes, hence the same probes) Δ_j = z_j(x) - z_j(y) = Σ_m ω_jᵀ D_m ψ_j with D = dW_x - dW_y.
With Gaussian probes Δ_j is distributed as Σ_i s_i g_i h_i (s_i the singular values of D, g and h
independent standard normals): mean 0, standard deviation ||D||_F. It is not Gaussian: for a rank-1
D it is ||D||·g·h, whose tail falls like exp(-t), so a few standard deviations are far from safe
(P(|gh| > 8) ≈ 9e-5). Its moment generating function Π_i (1 - λ²s_i²)^(-1/2) is at most
(1 - λ²||D||²)^(-1/2) (-log(1 - x) is convex and zero at zero, so superadditive), and Chernoff's
bound gives, for every D,

    P(|Δ_j| > K·||D||) ≤ 2·min_λ e^(-λK) (1 - λ²)^(-1/2),   which is 8.9e-17 at K = 40.

A duplicate has ||D|| ≤ τ = DUPLICATE_RTOL·max(||dW_x||, ||dW_y||), so `may_be_duplicate` rules out a
candidate with some |Δ_j| > SCREEN_SIGMAS·τ (K = 40) while wrongly ruling out a true duplicate with
probability at most 8 × 8.9e-17 ≈ 7e-16 per comparison, over the draw of the probes, for updates that
do not depend on them (an update crafted against the seeded probes can evade deduplication, as can one
perturbed just past the tolerance: deduplication is not a security boundary). Rounding of the stored
values is ~1e-7·||dW||, far below the threshold of 0.04·||dW||. Different updates of close norms
(||D|| ~ ||dW||) exceed it on some probe unless all 8 |Δ_j| fall below ~0.03·||D|| (probability
below 1e-8 even for a rank-1 D), so their factors are almost never read. The screen is only as valid
as the probes are stable: changing `zoo.domain.probes.draw_probes` changes every canonical hash too.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from zoo.domain.canonical import CanonicalFactors, frobenius_norm_sq
from zoo.domain.probes import probe_values, probes

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


@dataclass(frozen=True)
class Sketch:
    """An update's raw probe values z_j = Σ_modules ω_jᵀ·dW·ψ_j and its total Frobenius norm."""

    raw: list[float]
    norm: float

    @property
    def fingerprint(self) -> Fingerprint:
        """(z / ||dW||, ||dW||): what the canonical hash rounds."""
        if not self.norm > 0:
            return [0.0] * FINGERPRINT_DIM, self.norm
        return [v / self.norm for v in self.raw], self.norm


def sketch(modules: NamedFactors) -> Sketch:
    """Raw probe values and norm of an adapter, module by module: each module's factors are converted to float64 one
    at a time (a few MB, in cache), never all at once (stacking modules of one shape first, even in chunks of a few
    MB, measured 1.2-1.7 times slower on Llama-3-8B and SDXL adapters: the copy costs more than the calls it saves)."""
    z = torch.zeros(FINGERPRINT_DIM, dtype=torch.float64)
    for name, f in modules:
        omega, psi = probes(name, int(f.U.shape[0]), int(f.V.shape[0]), FINGERPRINT_DIM)
        z += probe_values(f, omega, psi).cpu()
    return Sketch(z.tolist(), math.sqrt(sum(frobenius_norm_sq(f) for _, f in modules)))


def fingerprint(modules: NamedFactors) -> Fingerprint:
    """(normalized probe values z, total Frobenius norm) of an adapter."""
    return sketch(modules).fingerprint


#: how many times the tolerance (DUPLICATE_RTOL·max norm) a raw probe value may differ by in a duplicate (see the
#: module docstring: a true duplicate is ruled out with probability below 1e-15)
SCREEN_SIGMAS = 40.0


def may_be_duplicate(x: Sketch, y_raw: object, y_norm: float | None, rtol: float = DUPLICATE_RTOL) -> bool:
    """False only when the raw probe values rule out ||dW_x - dW_y|| <= rtol·max norm (see the module docstring);
    True when they do not, or when y's stored values are missing or malformed (then only its factors can tell)."""
    if y_norm is None or not math.isfinite(y_norm) or not isinstance(y_raw, list) or len(y_raw) != len(x.raw):
        return True
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in y_raw):
        return True
    bound = SCREEN_SIGMAS * rtol * max(x.norm, y_norm)
    return all(abs(a - b) <= bound for a, b in zip(x.raw, y_raw, strict=True))


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
