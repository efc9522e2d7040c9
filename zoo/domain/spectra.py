"""Spectral descriptors of weight matrices and low-rank updates (no I/O).

Per module: singular values, spectral norm, Frobenius norm, stable rank, entropy
effective rank and, for full matrices, the heavy-tailed power-law exponent alpha of
the eigenvalue spectrum of WᵀW (HT-SR / WeightWatcher style: Clauset-Shalizi-Newman
maximum likelihood with x_min chosen by the Kolmogorov-Smirnov distance).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

#: Fewest eigenvalues in the tail for a power-law fit to be reported.
MIN_TAIL = 10


@dataclass(frozen=True)
class Spectrum:
    singular_values: list[float]
    spectral_norm: float
    frobenius_norm: float
    stable_rank: float
    effective_rank: float
    power_law_alpha: float | None = None
    power_law_xmin: float | None = None
    power_law_ks: float | None = None

    def as_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def spectrum_from_singular_values(singular_values: np.ndarray | torch.Tensor, fit_power_law: bool = False) -> Spectrum:
    """Descriptors from a vector of singular values (any order)."""
    s = np.sort(np.asarray(singular_values, dtype=np.float64))[::-1]
    s = s[s > 0]
    if s.size == 0:
        return Spectrum([], 0.0, 0.0, 0.0, 0.0)
    fro2 = float(np.sum(s**2))
    p = s / s.sum()
    entropy = float(-(p * np.log(p)).sum())
    alpha = xmin = ks = None
    if fit_power_law:
        fit = fit_power_law_tail(s**2)
        if fit is not None:
            alpha, xmin, ks = fit
    return Spectrum(
        singular_values=[float(x) for x in s],
        spectral_norm=float(s[0]),
        frobenius_norm=fro2**0.5,
        stable_rank=fro2 / float(s[0]) ** 2,
        effective_rank=float(np.exp(entropy)),
        power_law_alpha=alpha,
        power_law_xmin=xmin,
        power_law_ks=ks,
    )


#: rows of a matrix cast to float64 at a time while its Gram matrix is summed (bounds the working copy)
GRAM_CHUNK_ROWS = 4096


def singular_values(W: torch.Tensor) -> torch.Tensor:
    """Singular values (descending, float64) of a matrix (conv kernels flattened to out × rest), from the eigenvalues
    of its Gram matrix on the shorter side, summed in float64 a block of rows at a time: 5-6 times faster than an SVD
    on the CPU (2,048 × 5,632: 2.2 s against 12 s) and exact to float64's precision of σ² (values below ~1e-8 σ_max
    read as 0)."""
    W2 = W.reshape(W.shape[0], -1)
    if W2.shape[0] > W2.shape[1]:
        W2 = W2.T
    G = torch.zeros(W2.shape[0], W2.shape[0], dtype=torch.float64)
    for start in range(0, W2.shape[1], GRAM_CHUNK_ROWS):  # columns of the wide side, a block at a time
        block = W2[:, start : start + GRAM_CHUNK_ROWS].double()
        G.addmm_(block, block.T)
    return torch.linalg.eigvalsh(G).clamp_min(0).sqrt().flip(0)


def matrix_spectrum(W: torch.Tensor) -> Spectrum:
    """Full spectrum of a weight matrix (conv kernels flattened to out × rest)."""
    return spectrum_from_singular_values(singular_values(W).numpy(), fit_power_law=True)


def fit_power_law_tail(eigenvalues: np.ndarray) -> tuple[float, float, float] | None:
    """(alpha, x_min, KS distance) of the best power-law tail p(x) ∝ x^-alpha, x >= x_min.

    Every eigenvalue leaving at least MIN_TAIL in the tail is tried as x_min; alpha is the
    continuous MLE 1 + m / Σ ln(x/x_min) and the x_min with the smallest KS distance wins.
    """
    x = np.sort(np.asarray(eigenvalues, dtype=np.float64))
    x = x[x > 0]
    n = x.size
    if n < MIN_TAIL + 1:
        return None
    logx = np.log(x)
    suffix = np.cumsum(logx[::-1])[::-1]  # suffix[i] = Σ_{j>=i} ln x_j
    best: tuple[float, float, float] | None = None
    for start in range(0, n - MIN_TAIL + 1, 256):
        idx = np.arange(start, min(start + 256, n - MIN_TAIL + 1))
        m = n - idx
        denom = suffix[idx] - m * logx[idx]
        with np.errstate(divide="ignore", invalid="ignore"):
            alpha = 1.0 + m / denom
        # KS distance of every candidate tail, vectorized over (candidate, position).
        j = np.arange(n)[None, :]
        in_tail = j >= idx[:, None]
        rank = (j - idx[:, None] + 1) / m[:, None]
        ratio = np.exp(logx[None, :] - logx[idx][:, None])
        with np.errstate(over="ignore", invalid="ignore"):
            model = 1.0 - ratio ** (1.0 - alpha[:, None])
        gap = np.maximum(np.abs(rank - model), np.abs(rank - 1.0 / m[:, None] - model))
        D = np.where(in_tail, gap, 0.0).max(axis=1)
        D = np.where(np.isfinite(alpha) & (denom > 0), D, np.inf)
        k = int(np.argmin(D))
        if np.isfinite(D[k]) and (best is None or D[k] < best[2]):
            best = (float(alpha[k]), float(x[idx[k]]), float(D[k]))
    return best
