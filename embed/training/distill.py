"""W2T's self-supervised pretraining target and views: an exact training-free kernel among adapters computed from their
tokens, the distillation loss that makes the W2T cosine match it, and the view that re-seeds a head (pure torch).

The kernels are zoo.domain.channels' exact scores (EXACT_SCORES), computed from tokens (u, v, log σ, mask) so that
they need no factors (a training set read by embed.data.dataset holds only tokens): per module, with C_U = U_xᵀU_y and
C_V = V_xᵀV_y over the padded rank,

- "dw": Σ_m Σ_ab σ_a (C_U)_ab (C_V)_ab σ'_b / (‖σ‖ ‖σ'‖), σ over the whole adapter;
- "module": the same per module, over that module's ‖σ‖, averaged over the modules both adapters have;
- "input_gram": ‖diag(σ²)^½ C_V diag(σ'²)^½‖²_F / (‖σ²‖ ‖σ'²‖) per module, averaged the same way.

On full-width orthonormal factors they equal exact_cosines; on projected tokens (embed.data.tokens.TokenSpec) they are
its Johnson-Lindenstrauss estimate.
"""

from __future__ import annotations

import torch
from torch import nn

from embed.data.tokens import Batch, TypeTokens, n_rows

#: entries of the (chunk × rank × adapters × rank) overlap blocks of a module computed at once
KERNEL_BLOCK = 1 << 24
#: the target rows' temperature: a row of the exact kernel, standardized, is softmaxed at it (the W2T cosines at the
#: training's own temperature), so that the nearest few adapters by the exact score carry most of the target's mass
TARGET_TEMPERATURE = 0.3


def token_kernel(tokens: Batch, score: str) -> torch.Tensor:
    """(n, n) float64 exact score `score` ("dw", "module" or "input_gram") among all rows of `tokens`."""
    if score not in ("dw", "module", "input_gram"):
        raise ValueError(f"unknown exact score {score!r}; one of dw, module, input_gram")
    n = n_rows(tokens)
    total = torch.zeros(n, n, dtype=torch.float64)
    shared = torch.zeros(n, n, dtype=torch.float64)
    norms = torch.zeros(n, dtype=torch.float64)
    for tok in tokens.values():
        norms += _sigma(tok).pow(2).flatten(1).sum(dim=1)
    norms = norms.sqrt().clamp_min(1e-30)
    for tok in tokens.values():
        _add_type(tok, score, norms, total, shared)
    return total if score == "dw" else total / shared.clamp_min(1.0)


def _sigma(tok: TypeTokens) -> torch.Tensor:
    return (tok.log_sigma.double().exp() * tok.mask).masked_fill(~tok.mask, 0.0)


def _add_type(tok: TypeTokens, score: str, norms: torch.Tensor, total: torch.Tensor, shared: torch.Tensor) -> None:
    """Add one module type's per-module values (and, for the module means, its shared-module counts) to `total`: each
    v_i is weighted by c_i (σ_i / ‖σ²‖^½ of its module for the input Gram, σ_i / ‖σ‖ of its module or adapter for the
    others), so that the overlap C_V of weighted sides gives the score as Σ C_V² or Σ C_U ∘ C_V. Module by module,
    among the adapters that have it, one matrix product per side and chunk of rows."""
    n, M, R = tok.mask.shape
    sigma = _sigma(tok)
    if score == "input_gram":
        scale = sigma.pow(4).sum(dim=-1, keepdim=True).pow(0.25)
    elif score == "module":
        scale = sigma.pow(2).sum(dim=-1, keepdim=True).sqrt()
    else:
        scale = norms[:, None, None]
    weights = (sigma / scale.clamp_min(1e-30)).float()
    for m in range(M):
        rows = torch.nonzero(tok.mask[:, m].any(dim=-1)).flatten()
        P = len(rows)
        if not P:
            continue
        v = (tok.v[rows, m].float() * weights[rows, m, :, None]).reshape(P * R, -1)
        u = tok.u[rows, m].float().reshape(P * R, -1)
        chunk = max(1, KERNEL_BLOCK // (P * R * R))
        for start in range(0, P, chunk):
            part = slice(start * R, min(P, start + chunk) * R)
            c = (part.stop - part.start) // R
            cv = (v[part] @ v.T).reshape(c, R, P, R)
            overlap = cv if score == "input_gram" else (u[part] @ u.T).reshape(c, R, P, R)  # Σ C_V², or Σ C_U ∘ C_V
            value = (overlap * cv).sum(dim=(1, 3))
            at = rows[start : start + c]
            total[at[:, None], rows[None, :]] += value.double()
            shared[at[:, None], rows[None, :]] += 1.0


def distillation_loss(z: torch.Tensor, target: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(p ‖ q) averaged over rows, where q = softmax of the rows of the embeddings' cosine matrix at `temperature`
    and p = softmax of the target kernel's rows, each standardized, at TARGET_TEMPERATURE (self-pairs left out of
    both): the W2T cosine is pushed to rank every batch row's neighbours as the exact kernel does."""
    zn = nn.functional.normalize(z, dim=-1)
    eye = torch.eye(len(z), dtype=torch.bool, device=z.device)
    logits = (zn @ zn.T / temperature).masked_fill(eye, float("-inf"))
    t = target.to(z.device, z.dtype)
    off = (~eye).to(z.dtype)
    count = off.sum(dim=1, keepdim=True).clamp_min(1.0)
    mean = (t * off).sum(dim=1, keepdim=True) / count
    std = (((t - mean) * off).pow(2).sum(dim=1, keepdim=True) / count).sqrt().clamp_min(1e-6)
    p = torch.softmax(((t - mean) / std / TARGET_TEMPERATURE).masked_fill(eye, float("-inf")), dim=1)
    log_q = torch.log_softmax(logits, dim=1)
    return (p * (torch.log(p.clamp_min(1e-30)) - log_q.masked_fill(eye, 0.0))).masked_fill(eye, 0.0).sum(dim=1).mean()


def rotate_outputs(batch: Batch, gen: torch.Generator) -> Batch:
    """The tokens with every u_i of a type turned by one random orthogonal Q per adapter (Haar: QR of a Gaussian, signs
    fixed): dW → Q·dW, what a re-seeded head does to the output side. V, σ and the input Gram are unchanged."""
    out: Batch = {}
    for t, tok in batch.items():
        B, width = tok.u.shape[0], tok.u.shape[-1]
        q, r = torch.linalg.qr(torch.randn(B, width, width, generator=gen))
        q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)
        u = torch.einsum("bmri,bji->bmrj", tok.u, q.to(tok.u.dtype))
        out[t] = TypeTokens(u, tok.v, tok.log_sigma, tok.mask, tok.layers, tok.groups, tok.norms)
    return out
