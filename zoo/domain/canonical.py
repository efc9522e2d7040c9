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

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from zoo import deadline

#: Components with S_i <= ZERO_RTOL * S_max (or S_i == 0) are dropped as numerically zero.
ZERO_RTOL = 1e-6
#: The batched Gram/Cholesky path is used for a module when cond(BᵀB) and cond(AAᵀ) stay
#: below this; otherwise that module goes through Householder QR (orthonormality of the
#: Gram path degrades like float32 eps · cond(Gram)).
GRAM_COND_LIMIT = 1e3


@dataclass(frozen=True)
class CanonicalFactors:
    """Canonical components of one update: dW = U·diag(S)·Vᵀ; and, made from the factors given, their gauge."""

    U: torch.Tensor  # (out, k), orthonormal columns
    S: torch.Tensor  # (k,), descending, > 0
    V: torch.Tensor  # (in, k), orthonormal columns
    #: (M, N) with B = U·M and A = N·Vᵀ (M = Uᵀ·B = U'ᵀ·R_B, N = A·V = R_Aᵀ·V', r×r: the factors as given, which
    #: PEFT's factorwise merges need, zoo/domain/factorwise.py); None where the update's rank is below the factors'
    #: (B and A then have parts outside U and V that dW does not show) or where the factors were not given
    gauge: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, compare=False, repr=False)

    @property
    def rank(self) -> int:
        return int(self.S.shape[0])

    def delta(self) -> torch.Tensor:
        """Materialize dW (out × in); for tests and small modules only."""
        return (self.U * self.S) @ self.V.T


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
    return _finish(U, S, V, Up.T @ R_B.double(), R_A.double().T @ Vph.T)


def _finish(U: torch.Tensor, S: torch.Tensor, V: torch.Tensor, M: torch.Tensor, N: torch.Tensor) -> CanonicalFactors:
    """Keep the non-zero components (a prefix), fix their signs; the gauge (M, N) where every component is kept."""
    k = int(_keep_mask(S).sum())  # S is sorted descending: the kept components are a prefix
    U, V = U[:, :k], V[:, :k]
    signs = _column_signs(U)
    gauge = (M * signs.double()[:, None], N * signs.double()[None, :]) if 0 < k == M.shape[1] else None
    return CanonicalFactors(U=U * signs, S=S[:k].to(torch.float32), V=V * signs, gauge=_as_float32_pair(gauge))


def _as_float32_pair(gauge: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    return None if gauge is None else (gauge[0].to(torch.float32).contiguous(), gauge[1].to(torch.float32).contiguous())


def canonicalize_batched(
    A: torch.Tensor | Sequence[torch.Tensor],
    B: torch.Tensor | Sequence[torch.Tensor],
    scale: torch.Tensor | Sequence[float] | float = 1.0,
) -> list[CanonicalFactors]:
    """Canonicalize n modules of one rank r at once: A (n × r × in), B (n × out × r), stacked
    or as sequences of 2-D tensors (shapes may then differ between modules).

    A Cholesky-QR formulation: Gram matrices and the final products are float32 GEMMs that
    stream each factor twice, batched over the modules of each shape, and every r×r
    factorization (Cholesky, eigenvalues, SVD, triangular solve) runs once for all n modules,
    batched in float64. Modules whose Gram matrices are ill-conditioned (see GRAM_COND_LIMIT)
    fall back to Householder QR. Runs on whatever device A and B are on.
    """
    As = list(A.unbind(0) if isinstance(A, torch.Tensor) else A)
    Bs = list(B.unbind(0) if isinstance(B, torch.Tensor) else B)
    n = len(As)
    if n == 0:
        return []
    if len(Bs) != n or any(
        a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or a.shape[0] != As[0].shape[0] for a, b in zip(As, Bs, strict=True)
    ):
        raise ValueError("expected n pairs of A (r×in) and B (out×r) with one common rank r")
    shapes: dict[tuple[int, int], list[int]] = {}
    for i, (a, b) in enumerate(zip(As, Bs, strict=True)):
        shapes.setdefault((b.shape[0], a.shape[1]), []).append(i)
    groups = [(idx, _stack_float32([As[i] for i in idx]), _stack_float32([Bs[i] for i in idx])) for idx in shapes.values()]
    order = [i for idx, _, _ in groups for i in idx]  # the modules as the r×r batch holds them
    device = As[0].device
    scale_t = torch.as_tensor(scale, dtype=torch.float64).reshape(-1).expand(n).to(device)[order]

    # Gram matrices BᵀB of every module, then AAᵀ of every module: one batch for each r×r step
    G = torch.cat([b.transpose(1, 2) @ b for _, _, b in groups] + [a @ a.transpose(1, 2) for _, a, _ in groups]).double()
    L, info = torch.linalg.cholesky_ex(G)
    ok = (info == 0) & (_cond(G) < GRAM_COND_LIMIT)
    good = ok[:n] & ok[n:]
    L = torch.where(good.repeat(2)[:, None, None], L, torch.eye(L.shape[-1], dtype=L.dtype, device=device).expand_as(L))
    L_B, L_A = L[:n], L[n:]

    # s·R_B R_Aᵀ with R = Lᵀ; then U = B R_B⁻¹ U' and V = Aᵀ R_A⁻¹ V' as one r×r solve and one GEMM each.
    Up, S, Vph = torch.linalg.svd(scale_t[:, None, None] * (L_B.transpose(1, 2) @ L_A))
    C = torch.linalg.solve_triangular(L.transpose(1, 2), torch.cat([Up, Vph.transpose(1, 2)]), upper=True).to(torch.float32)
    keep = _keep_mask(S).sum(dim=-1).tolist()  # components are sorted, so the kept ones are a prefix
    S32 = S.to(torch.float32)
    is_good = good.tolist()
    M_all = Up.transpose(1, 2) @ L_B.transpose(1, 2)  # U'ᵀ·R_B with R = Lᵀ (the gauge, see CanonicalFactors)
    N_all = L_A @ Vph.transpose(1, 2)  # R_Aᵀ·V'

    out: list[CanonicalFactors | None] = [None] * n
    start = 0
    for idx, A3, B3 in groups:
        rows = slice(start, start + len(idx))
        U = B3 @ C[:n][rows]
        signs = _column_signs(U)
        U.mul_(signs[:, None, :])
        V = A3.transpose(1, 2) @ (C[n:][rows] * signs[:, None, :])
        signs64 = signs.double()
        M = (M_all[rows] * signs64[:, :, None]).to(torch.float32)
        N = (N_all[rows] * signs64[:, None, :]).to(torch.float32)
        for j, i in enumerate(idx):
            pos, k = start + j, keep[start + j]
            if not is_good[pos]:
                out[i] = canonicalize(A3[j], B3[j], float(scale_t[pos]))
            elif k == U.shape[-1]:
                out[i] = CanonicalFactors(U=U[j], S=S32[pos], V=V[j], gauge=(M[j], N[j]))
            else:
                out[i] = CanonicalFactors(U=U[j, :, :k].contiguous(), S=S32[pos, :k].contiguous(), V=V[j, :, :k].contiguous())
        start += len(idx)
    return [f for f in out if f is not None]


def _stack_float32(ts: list[torch.Tensor]) -> torch.Tensor:
    """Matrices of one shape stacked into one new float32 tensor, converted as they are copied: one kernel, one
    pass over the input and one allocation (converting each first and stacking after costs a second pass and an
    allocation per matrix, ten times slower for bf16 factors)."""
    out = torch.empty((len(ts), *ts[0].shape), dtype=torch.float32, device=ts[0].device)
    return torch.stack(ts, out=out)


def _column_signs(U: torch.Tensor) -> torch.Tensor:
    """+1/-1 per column (of each matrix of a stack): the sign of the column's largest-magnitude entry (one
    reduction, no temporaries)."""
    lo, hi = torch.aminmax(U, dim=-2)
    return torch.where(hi >= -lo, 1.0, -1.0).to(U.dtype)


def _cond(G: torch.Tensor) -> torch.Tensor:
    """2-norm condition number of symmetric PSD matrices (inf where singular)."""
    ev = torch.linalg.eigvalsh(G)
    lo, hi = ev[..., 0], ev[..., -1]
    return torch.where(lo > 0, hi / lo.clamp_min(torch.finfo(G.dtype).tiny), torch.full_like(hi, float("inf")))


def frobenius_norm_sq(x: CanonicalFactors) -> float:
    return float((x.S.double() ** 2).sum())


class LowRankModule(Protocol):
    """What canonicalize_modules reads of a module (zoo.formats.LoraModule is one): dW = scale · B · A."""

    @property
    def A(self) -> torch.Tensor: ...  # (r × in)

    @property
    def B(self) -> torch.Tensor: ...  # (out × r)

    @property
    def scale(self) -> float: ...

    @property
    def rank(self) -> int: ...


def pick_device(device: str | None) -> torch.device:
    """The device named, else cuda when available, else cpu."""
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def canonicalize_modules(modules: Sequence[LowRankModule], device: torch.device) -> list[CanonicalFactors]:
    """Canonical factors of every module, batched by rank, returned on the CPU in input order."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, m in enumerate(modules):
        groups[m.rank].append(i)
    out: list[CanonicalFactors | None] = [None] * len(modules)
    for idx in groups.values():
        deadline.check()  # a web call past its time limit stops here (zoo/deadline.py)
        As = [modules[i].A.to(device) for i in idx]
        Bs = [modules[i].B.to(device) for i in idx]
        scale = [modules[i].scale for i in idx]
        for i, f in zip(idx, canonicalize_batched(As, Bs, scale), strict=True):
            gauge = (f.gauge[0].cpu(), f.gauge[1].cpu()) if f.gauge is not None else None
            out[i] = CanonicalFactors(f.U.cpu(), f.S.cpu(), f.V.cpu(), gauge)
    return [f for f in out if f is not None]
