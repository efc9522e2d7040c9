"""Canonical components → padded token tensors, grouped by module type (one shape per type).

For module m of type t and rank component i: u_i (out_t), v_i (in_t) and log σ_i, with a mask
for padded components (adapters of lower rank) and for modules an adapter does not have.

Real adapters are wide (Llama-3-8B: up to 14,336) and have many modules (SDXL: 1,035), so a token's
u and v are bounded and so are the module tokens (`TokenSpec`):

- a side of width d > `width` is projected by a fixed, seeded Gaussian R (width × d, entries
  N(0, 1/width)): E⟨R u, R u′⟩ = ⟨u, u′⟩, so E[⟨R_u u, R_u u′⟩⟨R_v v, R_v v′⟩] = ⟨u, u′⟩⟨v, v′⟩
  (the u and v sides draw independent R), which is what the model's two-sided sketch of u vᵀ and a
  module's cosine rest on. Narrower sides keep their identity. R depends only on (seed, side,
  d): a checkpoint that records its seed and width projects a new adapter the same way.
- the modules of a space are put into at most `max_module_tokens` groups of one type and
  neighbouring layers (`module_groups`); the model pools the module tokens of a group into one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from embed.data.types import SpaceSchema, ZooAdapter

#: the widest u or v a token keeps: wider sides are projected to it
TOKEN_WIDTH = 256
#: the most module tokens an adapter gets (modules grouped by type and layer beyond it)
MAX_MODULE_TOKENS = 256


@dataclass(frozen=True)
class TokenSpec:
    """How adapters become tokens. The zero spec is that of checkpoints made before tokens were bounded: full width, a token per module."""

    width: int = 0  # the widest u or v side kept; 0: every side at its full width
    seed: int = 0  # seeds the projections
    max_module_tokens: int = 0  # 0: one module token per module

    def side_width(self, d: int) -> int:
        return min(d, self.width) if self.width else d

    def projector(self, side: str, d: int) -> torch.Tensor | None:
        """The (width, d) projection of a side ("u" or "v") of width d, or None where the side keeps its identity."""
        return None if self.side_width(d) == d else _gaussian(self.seed, side, d, self.width)

    def project(self, side: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows (n, d) at full width → (n, side_width(d)) float32."""
        R = self.projector(side, rows.shape[1])
        rows = rows.float()
        return rows if R is None else rows @ R.T


@functools.lru_cache(maxsize=64)
def _gaussian(seed: int, side: str, d: int, p: int) -> torch.Tensor:
    """A (p, d) Gaussian projection with entries N(0, 1/p), the same for the same (seed, side, d, p) on any machine."""
    digest = hashlib.sha256(f"w2t-projection|{seed}|{side}|{d}|{p}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randn(p, d, generator=gen) / p**0.5


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block on `n` torch threads (None: as it is), restoring the count after."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class TypeTokens:
    """Tokens of the modules of one type: B adapters × M modules × R components."""

    u: torch.Tensor  # (B, M, R, out), out ≤ the spec's width
    v: torch.Tensor  # (B, M, R, in)
    log_sigma: torch.Tensor  # (B, M, R), 0 where masked
    mask: torch.Tensor  # (B, M, R) bool: a real component
    layers: torch.Tensor  # (M,) layer index of each module
    groups: torch.Tensor  # (M,) the module token (over all types) each module is pooled into
    #: (B,) the norm of σ over all of the type's components of each adapter, where these tokens are only some of its
    #: modules (a training view); None: computed from these tokens
    norms: torch.Tensor | None = None

    def to(self, device: torch.device) -> TypeTokens:
        norms = None if self.norms is None else self.norms.to(device)
        u, v, log_sigma, mask, layers, groups = (
            t.to(device) for t in (self.u, self.v, self.log_sigma, self.mask, self.layers, self.groups)
        )
        return TypeTokens(u, v, log_sigma, mask, layers, groups, norms)

    def select(self, rows: torch.Tensor | slice) -> TypeTokens:
        norms = None if self.norms is None else self.norms[rows]
        return TypeTokens(self.u[rows], self.v[rows], self.log_sigma[rows], self.mask[rows], self.layers, self.groups, norms)

    def sigma_norms(self) -> torch.Tensor:
        """(B,) the norm of σ over the type's components."""
        return (self.log_sigma.exp() * self.mask).pow(2).flatten(1).sum(dim=1).sqrt()


Batch = dict[str, TypeTokens]


def max_rank(adapters: list[ZooAdapter]) -> int:
    return max((f.rank for a in adapters for f in a.factors.values()), default=1) or 1


@functools.lru_cache(maxsize=16)
def modules_by_type(schema: SpaceSchema) -> dict[str, list[str]]:
    """Module names per type key (see SpaceSchema.type_key), types sorted, names in the schema's order (computed once a
    schema: do not change what it returns)."""
    by_type: dict[str, list[str]] = {}
    for name, o, i in schema.modules:
        by_type.setdefault(schema.type_key(name, o, i), []).append(name)
    return {t: by_type[t] for t in sorted(by_type)}


def module_groups(schema: SpaceSchema, max_tokens: int) -> tuple[dict[str, torch.Tensor], int]:
    """(per type: the group of each of its modules, number of groups). One group per module while there are at most
    `max_tokens` modules (or `max_tokens` is 0), numbered through the types in sorted order. Beyond it, a type of m_t
    of the M modules gets 1 + ⌊(max_tokens − T)·m_t / M⌋ groups of consecutive layers (T types; a space of more
    types than `max_tokens` gets one group per type)."""
    by_type = modules_by_type(schema)
    total = sum(len(v) for v in by_type.values())
    grouped = bool(max_tokens) and total > max_tokens
    spare = max(0, max_tokens - len(by_type))
    out: dict[str, torch.Tensor] = {}
    start = 0
    for mtype, names in by_type.items():
        if not grouped:
            out[mtype] = torch.arange(start, start + len(names))
            start += len(names)
            continue
        n_groups = min(len(names), 1 + spare * len(names) // total)
        order = sorted(range(len(names)), key=lambda j: (schema.layer_of(names[j]), names[j]))
        groups = torch.empty(len(names), dtype=torch.long)
        for rank_in_type, j in enumerate(order):
            groups[j] = start + rank_in_type * n_groups // len(names)
        out[mtype] = groups
        start += n_groups
    return out, start


def token_shapes(schema: SpaceSchema, spec: TokenSpec) -> dict[str, tuple[int, int]]:
    """Per type: the widths of its tokens' u and v."""
    return {t: (spec.side_width(o), spec.side_width(i)) for t, (o, i) in schema.type_shapes().items()}


def allocate(n: int, schema: SpaceSchema, rank: int, spec: TokenSpec = TokenSpec()) -> Batch:
    """Empty (masked) tokens for n adapters, to be filled by `fill`."""
    widths = token_shapes(schema, spec)
    groups, _ = module_groups(schema, spec.max_module_tokens)
    out: Batch = {}
    for mtype, names in modules_by_type(schema).items():
        o, i = widths[mtype]
        out[mtype] = TypeTokens(
            torch.zeros(n, len(names), rank, o),
            torch.zeros(n, len(names), rank, i),
            torch.zeros(n, len(names), rank),
            torch.zeros(n, len(names), rank, dtype=torch.bool),
            torch.tensor([schema.layer_of(nm) for nm in names]),
            groups[mtype],
        )
    return out


def fill(batch: Batch, row: int, adapter: ZooAdapter, schema: SpaceSchema, spec: TokenSpec = TokenSpec()) -> None:
    """Write one adapter's tokens into a row of `batch`. Its factors may be at full width (projected here, a type's
    modules in one product per side) or already projected (`project`); components beyond the batch's rank are cut."""
    for mtype, names in modules_by_type(schema).items():
        tok = batch[mtype]
        rank = tok.mask.shape[-1]
        present = [
            (m, f, min(f.rank, rank)) for m, f in ((m, adapter.factors.get(n)) for m, n in enumerate(names)) if f is not None and f.rank
        ]
        if not present:
            continue
        us = _side(spec, "u", torch.cat([f.U[:, :k].T for _, f, k in present]), tok.u.shape[-1])
        vs = _side(spec, "v", torch.cat([f.V[:, :k].T for _, f, k in present]), tok.v.shape[-1])
        at = 0
        for m, f, k in present:
            tok.u[row, m, :k], tok.v[row, m, :k] = us[at : at + k], vs[at : at + k]
            tok.log_sigma[row, m, :k] = torch.log(f.S[:k].float().clamp_min(1e-12))
            tok.mask[row, m, :k] = True
            at += k


def _side(spec: TokenSpec, side: str, rows: torch.Tensor, width: int) -> torch.Tensor:
    """A type's components (n, d) as token rows (n, width): projected, or kept (narrow, or projected already)."""
    if rows.shape[1] == width:
        return rows.float()
    if spec.side_width(rows.shape[1]) != width:
        raise ValueError(f"a factor of width {rows.shape[1]} does not make tokens of width {width}")
    return spec.project(side, rows)


def tokenize(adapters: Sequence[ZooAdapter], schema: SpaceSchema, rank: int, spec: TokenSpec = TokenSpec()) -> Batch:
    """Padded tensors per module type for the adapters (components beyond `rank` are cut)."""
    out = allocate(len(adapters), schema, rank, spec)
    for b, a in enumerate(adapters):
        fill(out, b, a, schema, spec)
    return out


def project(adapter: ZooAdapter, spec: TokenSpec) -> ZooAdapter:
    """The adapter with every factor side wider than the spec's width projected (what `fill` would do): the form a
    training set is held in. S is kept; U and V are no longer orthonormal."""
    from zoo.domain.canonical import CanonicalFactors

    factors = {n: CanonicalFactors(spec.project("u", f.U.T).T, f.S.float(), spec.project("v", f.V.T).T) for n, f in adapter.factors.items()}
    return ZooAdapter(adapter.id, adapter.name, factors, adapter.labels, adapter.measurements, adapter.source_uri)


def tokens_per_adapter(batch: Batch) -> int:
    """Rank tokens of one adapter (modules × padded rank, over the types)."""
    return sum(int(t.mask.shape[1] * t.mask.shape[2]) for t in batch.values())


def n_rows(batch: Batch) -> int:
    return next(iter(batch.values())).mask.shape[0] if batch else 0


def select(batch: Batch, rows: torch.Tensor | slice) -> Batch:
    return {t: tok.select(rows) for t, tok in batch.items()}


def to_device(batch: Batch, device: torch.device) -> Batch:
    return {t: tok.to(device) for t, tok in batch.items()}
