"""Canonical form of a low-rank update dW = s·B·A (the Weight2Token idea).

Every factorization of the same update maps to the same (U, S, V):

    B = Q_B R_B,  Aᵀ = Q_A R_A,  s·R_B R_Aᵀ = U' S V'ᵀ,  U = Q_B U',  V = Q_A V'

then the sign of each component (u_i, v_i) is fixed so that the largest-magnitude
entry of u_i is positive, components are sorted by S descending and numerically
zero components are dropped.

Pure torch, device-agnostic, no I/O. The r×r parts are computed in float64, the
large GEMMs in float32 whatever the stored dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Components with S_i <= ZERO_RTOL * S_max (or S_i == 0) are dropped as numerically zero.
ZERO_RTOL = 1e-6
#: The batched Gram/Cholesky path is used for a module when cond(BᵀB) and cond(AAᵀ) stay
#: below this; otherwise that module goes through Householder QR (orthonormality of the
#: Gram path degrades like float32 eps · cond(Gram)).
GRAM_COND_LIMIT = 1e3


@dataclass(frozen=True)
class CanonicalFactors:
    """Canonical components of one update: dW = U·diag(S)·Vᵀ."""

    U: torch.Tensor  # (out, k), orthonormal columns
    S: torch.Tensor  # (k,), descending, > 0
    V: torch.Tensor  # (in, k), orthonormal columns

    @property
    def rank(self) -> int:
        return int(self.S.shape[0])

    def delta(self) -> torch.Tensor:
        """Materialize dW (out × in); for tests and small modules only."""
        return (self.U * self.S) @ self.V.T


def _fix_signs(U: torch.Tensor, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flip (u_i, v_i) so that the largest-|.| entry of each u_i is positive. Works batched."""
    idx = U.abs().argmax(dim=-2, keepdim=True)
    signs = torch.sign(torch.gather(U, -2, idx))
    signs = torch.where(signs == 0, torch.ones_like(signs), signs)
    return U * signs, V * signs


def _keep_mask(S: torch.Tensor) -> torch.Tensor:
    smax = S.max(dim=-1, keepdim=True).values if S.shape[-1] else S
    return (ZERO_RTOL * smax < S) & (S > 0)


def _as_float32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32) if x.dtype != torch.float32 else x


def canonicalize(A: torch.Tensor, B: torch.Tensor, scale: float = 1.0) -> CanonicalFactors:
    """Canonical form of scale·B·A for one module (Householder QR path, the reference).

    A is (r × in), B is (out × r).
    """
    if A.ndim != 2 or B.ndim != 2 or A.shape[0] != B.shape[1]:
        raise ValueError(f"expected A (r×in) and B (out×r), got A {tuple(A.shape)} and B {tuple(B.shape)}")
    A32, B32 = _as_float32(A), _as_float32(B)
    Q_B, R_B = torch.linalg.qr(B32)
    Q_A, R_A = torch.linalg.qr(A32.T)
    core = float(scale) * (R_B.double() @ R_A.double().T)
    Up, S, Vph = torch.linalg.svd(core)
    U = Q_B @ Up.to(torch.float32)
    V = Q_A @ Vph.T.to(torch.float32)
    return _finish(U, S, V)


def _finish(U: torch.Tensor, S: torch.Tensor, V: torch.Tensor) -> CanonicalFactors:
    U, V = _fix_signs(U, V)
    keep = _keep_mask(S)
    return CanonicalFactors(U=U[:, keep].contiguous(), S=S[keep].to(torch.float32), V=V[:, keep].contiguous())


def canonicalize_batched(
    A: torch.Tensor, B: torch.Tensor, scale: torch.Tensor | float = 1.0
) -> list[CanonicalFactors]:
    """Canonicalize n modules of one shape at once: A (n × r × in), B (n × out × r).

    Uses a Cholesky-QR formulation in batched GEMMs (Grams and the final products in
    float32, the r×r factorizations in float64); modules whose Gram matrices are
    ill-conditioned fall back to Householder QR. Runs on whatever device A and B are on.
    """
    if A.ndim != 3 or B.ndim != 3 or A.shape[0] != B.shape[0] or A.shape[1] != B.shape[2]:
        raise ValueError(f"expected A (n×r×in) and B (n×out×r), got {tuple(A.shape)} and {tuple(B.shape)}")
    n = A.shape[0]
    A32, B32 = _as_float32(A), _as_float32(B)
    scale_t = torch.as_tensor(scale, dtype=torch.float64, device=A.device).expand(n)

    G_B = (B32.transpose(1, 2) @ B32).double()
    G_A = (A32 @ A32.transpose(1, 2)).double()
    L_B, info_b = torch.linalg.cholesky_ex(G_B)
    L_A, info_a = torch.linalg.cholesky_ex(G_A)
    good = (info_b == 0) & (info_a == 0) & (_cond(G_B) < GRAM_COND_LIMIT) & (_cond(G_A) < GRAM_COND_LIMIT)

    # s·R_B R_Aᵀ with R = Lᵀ
    core = scale_t[:, None, None] * (L_B.transpose(1, 2) @ L_A)
    core = torch.where(good[:, None, None], core, torch.zeros_like(core))
    Up, S, Vph = torch.linalg.svd(core)
    # U = B R_B⁻¹ U' and V = Aᵀ R_A⁻¹ V' computed as one small solve then one GEMM each.
    eye = torch.eye(L_B.shape[-1], dtype=L_B.dtype, device=L_B.device)
    safe_LB = torch.where(good[:, None, None], L_B, eye)
    safe_LA = torch.where(good[:, None, None], L_A, eye)
    C_B = torch.linalg.solve_triangular(safe_LB.transpose(1, 2), Up, upper=True)
    C_A = torch.linalg.solve_triangular(safe_LA.transpose(1, 2), Vph.transpose(1, 2), upper=True)
    U = B32 @ C_B.to(torch.float32)
    V = A32.transpose(1, 2) @ C_A.to(torch.float32)

    out: list[CanonicalFactors] = []
    good_list = good.tolist()
    for i in range(n):
        if good_list[i]:
            out.append(_finish(U[i], S[i], V[i]))
        else:
            out.append(canonicalize(A32[i], B32[i], float(scale_t[i])))
    return out


def _cond(G: torch.Tensor) -> torch.Tensor:
    """2-norm condition number of symmetric PSD matrices (inf where singular)."""
    ev = torch.linalg.eigvalsh(G)
    lo, hi = ev[..., 0], ev[..., -1]
    return torch.where(lo > 0, hi / lo.clamp_min(torch.finfo(G.dtype).tiny), torch.full_like(hi, float("inf")))


def frobenius_norm_sq(x: CanonicalFactors) -> float:
    return float((x.S.double() ** 2).sum())
