"""Training views of W2T's token batches: a random subset of the modules, augmented views (weak components cut,
modules dropped, rescaled), and mixes of two adapters of one task."""

from __future__ import annotations

import torch
from torch import nn

from embed.data.tokens import Batch, TypeTokens, n_rows, select
from embed.training.train_options import TrainOptions


def module_view(tokens: Batch, rows: torch.Tensor, rank_tokens: int, gen: torch.Generator) -> tuple[Batch, float]:
    """(the rows' tokens of as many modules as `rank_tokens` allows, drawn at random over all types; the readout scale,
    modules / drawn). Each type keeps the σ norm of the whole adapter, so that a module's sketch is scaled as when all
    are seen, and the readout of the sketches, scaled, is as large on average. All modules where they fit."""
    sizes = [tok.mask.shape[1] for tok in tokens.values()]
    total, rank = sum(sizes), next(iter(tokens.values())).mask.shape[2]
    k = max(1, rank_tokens // rank) if rank_tokens else total
    if k >= total:
        return select(tokens, rows), 1.0
    chosen = torch.randperm(total, generator=gen)[:k].sort().values
    out: Batch = {}
    start = 0
    for (t, tok), m in zip(tokens.items(), sizes, strict=True):
        idx = chosen[(chosen >= start) & (chosen < start + m)] - start
        start += m
        if len(idx):
            r, c = rows[:, None], idx[None, :]
            norms = (tok.log_sigma[rows].exp() * tok.mask[rows]).pow(2).flatten(1).sum(dim=1).sqrt()
            out[t] = TypeTokens(tok.u[r, c], tok.v[r, c], tok.log_sigma[r, c], tok.mask[r, c], tok.layers[idx], tok.groups[idx], norms)
    return out, total / k


#: a training view's noise on u and v: N(0, VIEW_NOISE² / width) per coordinate (added by the model, embed.w2t.model.projected_noise)
VIEW_NOISE = 0.02


def augment(batch: Batch, gen: torch.Generator, options: TrainOptions, contrastive_view: bool) -> tuple[Batch, torch.Tensor | None]:
    """A training view's tokens: its weakest components dropped (the model adds the view's noise, VIEW_NOISE), and where the
    options ask, its scale changed and some of its modules dropped; with the per-row factor its readout is scaled by
    (None: 1). Sign flips of (u_i, v_i) are left out of views: the model is invariant to them, and they cost two passes
    over u and v."""
    rows = n_rows(batch)
    log_scale = None
    if contrastive_view and options.augment_rescale:
        log_scale = (2 * torch.rand(rows, generator=gen) - 1) * options.augment_rescale
    dropped, readout = module_dropout(batch, gen, options.augment_module_dropout) if contrastive_view else ({}, None)
    out: Batch = {}
    for t, tok in batch.items():
        u, v, ls, mask = tok.u, tok.v, tok.log_sigma, tok.mask
        norms = tok.norms
        if t in dropped:  # the sketches stay normalized by the whole adapter's σ, as in module_view
            norms = tok.sigma_norms() if norms is None else norms
            mask = mask & ~dropped[t][..., None]
            ls = ls.masked_fill(~mask, 0.0)
        if options.augment_sign_flips:
            signs = torch.where(torch.rand(mask.shape, generator=gen) < 0.5, -1.0, 1.0)[..., None]
            u, v = u * signs, v * signs
        if options.augment_rank_permutations:
            perm = torch.argsort(torch.rand(mask.shape, generator=gen), dim=-1)
            u, v = torch.gather(u, 2, perm[..., None].expand_as(u)), torch.gather(v, 2, perm[..., None].expand_as(v))
            ls, mask = torch.gather(ls, 2, perm), torch.gather(mask, 2, perm)
        if contrastive_view:
            # drop the weakest components: keep a random 50-100 % of each module's rank
            count = mask.sum(dim=-1, keepdim=True).float()
            keep = torch.ceil(count * (0.5 + 0.5 * torch.rand(count.shape, generator=gen)))
            order = torch.argsort(torch.argsort(-ls.masked_fill(~mask, float("-inf")), dim=-1), dim=-1)
            mask = mask & (order < keep)
            ls = ls.masked_fill(~mask, 0.0)
        if log_scale is not None:
            ls = (ls + log_scale[:, None, None]).masked_fill(~mask, 0.0)
            norms = None if norms is None else norms * log_scale.exp()
        out[t] = TypeTokens(u, v, ls, mask, tok.layers, tok.groups, norms)
    return out, readout


def module_dropout(batch: Batch, gen: torch.Generator, share: float) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """(per type: the modules (B, M) a view drops, the readout factor per row: modules / modules kept). Each adapter
    drops each of its modules with a probability drawn from U(0, share), and keeps at least one."""
    if not share:
        return {}, None
    present = {t: tok.mask.any(dim=-1) for t, tok in batch.items()}
    p = torch.rand(n_rows(batch), generator=gen) * share
    drop = {t: (torch.rand(m.shape, generator=gen) < p[:, None]) & m for t, m in present.items()}
    have = torch.stack([m.sum(dim=1) for m in present.values()]).sum(dim=0)
    kept = torch.stack([(m & ~drop[t]).sum(dim=1) for t, m in present.items()]).sum(dim=0)
    none_left = kept == 0  # such an adapter keeps them all
    drop = {t: d & ~none_left[:, None] for t, d in drop.items()}
    kept = torch.where(none_left, have, kept)
    return drop, have.float() / kept.clamp_min(1).float()


def mix_partners(rows: torch.Tensor, train: torch.Tensor, groups: torch.Tensor, share: float, gen: torch.Generator) -> torch.Tensor:
    """For each row: another of the `train` rows in its group (its task) to be mixed with, drawn at random, for a `share`
    of the rows that have one; -1 for the others."""
    out = torch.full_like(rows, -1)
    pick = torch.rand(len(rows), generator=gen) < share
    for i in torch.nonzero(pick).flatten().tolist():
        mates = train[(groups[train] == groups[rows[i]]) & (train != rows[i])]
        if len(mates):
            out[i] = mates[int(torch.randint(len(mates), (1,), generator=gen))]
    return out


def mix(batch: Batch, mates: Batch, lam: torch.Tensor) -> Batch:
    """Each row's update mixed with its mate's, λ dW + (1 − λ) dW′ per module (λ per row), as canonical tokens again:
    QR of both sides' stacked components, SVD of the small core, the strongest components kept up to the padded rank.
    Where the tokens carry the whole adapters' σ norms (a module view), the mix's is estimated as the λ-weighted one
    scaled by what the drawn modules show of the mix."""
    out: Batch = {}
    for t, a in batch.items():
        b = mates[t]
        rank = a.mask.shape[-1]
        weights = torch.cat([lam[:, None, None] * a.log_sigma.exp() * a.mask, (1 - lam)[:, None, None] * b.log_sigma.exp() * b.mask], dim=2)
        qu, ru = torch.linalg.qr(torch.cat([a.u, b.u], dim=2).transpose(-1, -2))  # (B, M, out, K), (B, M, K, 2R)
        qv, rv = torch.linalg.qr(torch.cat([a.v, b.v], dim=2).transpose(-1, -2))
        left, sigma, right_t = torch.linalg.svd((ru * weights[..., None, :]) @ rv.transpose(-1, -2), full_matrices=False)
        k = min(rank, sigma.shape[-1])
        u = (qu @ left[..., :k]).transpose(-1, -2)
        v = (qv @ right_t[..., :k, :].transpose(-1, -2)).transpose(-1, -2)
        sigma = sigma[..., :k]
        mask = sigma > 1e-6 * sigma.amax(dim=-1, keepdim=True).clamp_min(1e-30)
        if k < rank:  # a side narrower than the rank
            pad = rank - k
            u, v = nn.functional.pad(u, (0, 0, 0, pad)), nn.functional.pad(v, (0, 0, 0, pad))
            sigma, mask = nn.functional.pad(sigma, (0, pad)), nn.functional.pad(mask, (0, pad))
        log_sigma = torch.log(sigma.clamp_min(1e-12)).masked_fill(~mask, 0.0)
        norms = None
        if a.norms is not None and b.norms is not None:
            drawn = (sigma * mask).pow(2).flatten(1).sum(dim=1).sqrt()
            drawn_each = lam * a.sigma_norms() + (1 - lam) * b.sigma_norms()
            norms = drawn * (lam * a.norms + (1 - lam) * b.norms) / drawn_each.clamp_min(1e-12)
        out[t] = TypeTokens(u * mask[..., None], v * mask[..., None], log_sigma, mask, a.layers, a.groups, norms)
    return out


def copy_tokens(tok: TypeTokens) -> TypeTokens:
    norms = None if tok.norms is None else tok.norms.clone()
    return TypeTokens(tok.u.clone(), tok.v.clone(), tok.log_sigma.clone(), tok.mask.clone(), tok.layers, tok.groups, norms)


def readout_scale(scale: float, per_row: torch.Tensor | None, device: torch.device) -> float | torch.Tensor:
    """A view's readout factor: the module view's, times each row's where modules were dropped from it."""
    return scale if per_row is None else (per_row * scale).to(device)
