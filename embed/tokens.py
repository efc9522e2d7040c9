"""Canonical components → padded token tensors, grouped by module type (one shape per type).

For module m of type t and rank component i: u_i (out_t), v_i (in_t) and log σ_i, with a mask
for padded components (adapters of lower rank) and for modules an adapter does not have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from embed.types import SpaceSchema, ZooAdapter


@dataclass
class TypeTokens:
    """Tokens of the modules of one type: B adapters × M modules × R components."""

    u: torch.Tensor  # (B, M, R, out)
    v: torch.Tensor  # (B, M, R, in)
    log_sigma: torch.Tensor  # (B, M, R), 0 where masked
    mask: torch.Tensor  # (B, M, R) bool: a real component
    layers: torch.Tensor  # (M,) layer index of each module

    def to(self, device: torch.device) -> TypeTokens:
        return TypeTokens(self.u.to(device), self.v.to(device), self.log_sigma.to(device), self.mask.to(device), self.layers.to(device))

    def select(self, rows: torch.Tensor) -> TypeTokens:
        return TypeTokens(self.u[rows], self.v[rows], self.log_sigma[rows], self.mask[rows], self.layers)


Batch = dict[str, TypeTokens]


def max_rank(adapters: list[ZooAdapter]) -> int:
    return max((f.rank for a in adapters for f in a.factors.values()), default=1) or 1


def tokenize(adapters: list[ZooAdapter], schema: SpaceSchema, rank: int) -> Batch:
    """Padded tensors per module type for the adapters (components beyond `rank` are cut)."""
    shapes = schema.type_shapes()
    by_type: dict[str, list[str]] = {}
    for name, o, i in schema.modules:
        by_type.setdefault(schema.type_key(name, o, i), []).append(name)
    out: Batch = {}
    n = len(adapters)
    for mtype, names in by_type.items():
        o, i = shapes[mtype]
        u = torch.zeros(n, len(names), rank, o)
        v = torch.zeros(n, len(names), rank, i)
        ls = torch.zeros(n, len(names), rank)
        mask = torch.zeros(n, len(names), rank, dtype=torch.bool)
        for b, a in enumerate(adapters):
            for m, name in enumerate(names):
                f = a.factors.get(name)
                if f is None or f.rank == 0:
                    continue
                k = min(f.rank, rank)
                u[b, m, :k] = f.U[:, :k].T
                v[b, m, :k] = f.V[:, :k].T
                ls[b, m, :k] = torch.log(f.S[:k].clamp_min(1e-12))
                mask[b, m, :k] = True
        layers = torch.tensor([schema.layer_of(nm) for nm in names])
        out[mtype] = TypeTokens(u, v, ls, mask, layers)
    return out


def select(batch: Batch, rows: torch.Tensor) -> Batch:
    return {t: tok.select(rows) for t, tok in batch.items()}


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {t: tok.to(device) for t, tok in batch.items()}
