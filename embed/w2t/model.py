"""The Weight2Token transformer and its prediction heads (pure torch; no I/O, no database).

Per rank component i of a module: the outer product (P_u u_i)(P_v v_i)ᵀ of per-module-type
projections (a learned two-sided sketch of u_i v_iᵀ, invariant to the joint sign flip
(u_i, v_i) → (−u_i, −v_i)), linearly embedded and FiLM-conditioned on log σ_i. A small transformer mixes the rank tokens of a module; rank
pooling
uses a learned query with a σ prior (log σ_i/σ_max added to the attention logits), so weak
components count little. Module tokens get layer and module-type embeddings, a transformer over
modules mixes them, and attention pooling gives one vector per adapter. A linear readout of
every module's σ-weighted sketch, side by side, is added to that vector: attention pooling
averages module identity away, and a linear classifier on a fixed dW sketch is strong.

Bounded for real adapters (embed/data/tokens.py): u and v arrive projected to at most
`token_width` dims, and where a space has more than `max_module_tokens` modules, the module tokens
of a group (one type, neighbouring layers) are averaged into one and their sketches summed (a
sketch of the group's summed update: one type shares P_u, P_v), so that the module transformer and
the readout see at most `module_groups` tokens. A config without these fields (a checkpoint from
before) keeps full widths and a token per module.

Gram sketches (`gram_sketches`): the first-order sketch is linear in u, so a rotation of dW's output side (dW → Q·dW,
what a re-seeded classifier head does to a run's update) moves it. Beside it each module gets two second-order,
sign-invariant sketches, of the input Gram dWᵀdW = V S² Vᵀ and of the output Gram dW dWᵀ = U S² Uᵀ:
Σ_i s_i² (P_v v_i)(P_v v_i)ᵀ and Σ_i s_i² (P_u u_i)(P_u u_i)ᵀ with s_i² = σ_i² / Σ_module σ², so each has the module's
unit weight whatever dW's scale. The input one ignores u altogether (any Q). Both feed the module token (a linear
embedding added to it) and the readout (beside the first-order sketch). A config without the field (before) has neither.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import cast

import torch
from torch import nn

from embed.data.tokens import Batch, TokenSpec, TypeTokens


@dataclass
class W2TConfig:
    type_shapes: dict[str, tuple[int, int]]  # module type -> (out, in)
    n_layers: int
    n_modules: int = 0  # modules in the space; > 0: a linear readout of all modules' sketches, concatenated
    dim: int = 64
    embed_dim: int = 64
    outer_dim: int = 16
    heads: int = 4
    rank_layers: int = 1
    module_layers: int = 2
    dropout: float = 0.0
    categorical: dict[str, list[str]] = field(default_factory=dict)  # attribute -> classes
    regression: list[str] = field(default_factory=list)  # measured metrics
    token_width: int = 0  # u and v wider than this arrive projected to it (embed.data.tokens.TokenSpec); 0: full width
    projection_seed: int = 0
    max_module_tokens: int = 0  # 0: a module token per module
    module_groups: int = 0  # module tokens (embed.data.tokens.module_groups); 0: n_modules, one per module
    gram_sketches: bool = False  # second-order input and output Gram sketches per module (module token and readout)
    #: how the weights were pretrained (embed.training.pretrain.pretrain: the distilled score, epochs, views, losses); {}: not
    pretraining: dict[str, object] = field(default_factory=dict)

    @property
    def tokens(self) -> TokenSpec:
        """How adapters are tokenized for this model."""
        return TokenSpec(self.token_width, self.projection_seed, self.max_module_tokens)

    @property
    def sketch_width(self) -> int:
        """Features per module token the readout reads: the first-order sketch (k²), and the two Gram sketches (2 k²)."""
        return self.outer_dim**2 * (3 if self.gram_sketches else 1)

    @property
    def n_tokens(self) -> int:
        """Module tokens per adapter (and blocks of the readout)."""
        return self.module_groups or self.n_modules

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["type_shapes"] = {k: list(v) for k, v in self.type_shapes.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> W2TConfig:
        d = dict(d)
        d["type_shapes"] = {k: (int(v[0]), int(v[1])) for k, v in d["type_shapes"].items()}
        return cls(**d)


def _encoder(dim: int, heads: int, layers: int, dropout: float) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=dropout, batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def projected_noise(weight: torch.Tensor, shape: torch.Size, noise: float, generator: torch.Generator | None) -> torch.Tensor:
    """A draw of P n for n ~ N(0, noise²/p · I_p), P = `weight` (k × p), of `shape` (..., k): as L z with L Lᵀ = P Pᵀ
    (L constant to autograd: P itself where p ≤ k, else the Cholesky factor of P Pᵀ) and z ~ N(0, I) min(k, p) wide,
    so that its cost does not grow with p."""
    k, p = weight.shape
    P = weight.detach().float()
    L = P if p <= k else torch.linalg.cholesky(P @ P.T + 1e-12 * torch.eye(k, device=P.device))
    z = torch.randn(*shape[:-1], L.shape[1], generator=generator).to(weight.device)
    return (z @ L.T) * (noise / p**0.5)


class AttentionPool(nn.Module):
    """Softmax attention of a learned query over tokens, with an optional additive prior."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(dim) / dim**0.5)
        self.key = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, prior: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.key(x) @ self.query / x.shape[-1] ** 0.5
        if prior is not None:
            logits = logits + prior
        logits = logits.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows with nothing valid pool to 0
        return (weights.unsqueeze(-1) * x).sum(dim=-2)


class W2T(nn.Module):
    def __init__(self, config: W2TConfig) -> None:
        super().__init__()
        self.config = config
        d = config.dim
        self.types = sorted(config.type_shapes)
        k = config.outer_dim
        width = config.tokens.side_width
        self.proj_u = nn.ModuleDict({t: nn.Linear(width(o), k, bias=False) for t, (o, _) in config.type_shapes.items()})
        self.proj_v = nn.ModuleDict({t: nn.Linear(width(i), k, bias=False) for t, (_, i) in config.type_shapes.items()})
        self.token = nn.Linear(k * k, d)
        self.sketch = nn.Linear(k * k, d)
        self.gram = nn.Linear(2 * k * k, d) if config.gram_sketches else None
        self.film = nn.Sequential(nn.Linear(2, d), nn.GELU(), nn.Linear(d, 2 * d))
        self.rank_encoder = _encoder(d, config.heads, config.rank_layers, config.dropout)
        self.rank_pool = AttentionPool(d)
        self.layer_emb = nn.Embedding(config.n_layers + 1, d)
        self.type_emb = nn.Embedding(len(self.types), d)
        self.module_encoder = _encoder(d, config.heads, config.module_layers, config.dropout)
        self.module_pool = AttentionPool(d)
        self.out = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, config.embed_dim))
        # the learned two-sided sketches of every module side by side (module identity kept), read out
        # linearly: the path that a linear classifier on a fixed dW sketch shows to be strong
        self.readout = (
            nn.Sequential(nn.Dropout(config.dropout), nn.Linear(config.n_tokens * config.sketch_width, config.embed_dim))
            if config.n_modules
            else None
        )
        self.heads = nn.ModuleDict({k: nn.Linear(config.embed_dim, len(v)) for k, v in config.categorical.items()})
        self.regressors = nn.ModuleDict({k: nn.Linear(config.embed_dim, 1) for k in config.regression})

    def module_tokens(
        self, mtype: str, tok: TypeTokens, noise: float = 0.0, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, M, R, _ = tok.u.shape
        scale = tok.u.shape[-1] ** 0.5
        a = self.proj_u[mtype](tok.u)  # (B, M, R, k)
        b = self.proj_v[mtype](tok.v)
        if noise:  # P(u + n), n ~ N(0, noise²/width): drawn where it is k wide, not width wide
            # the projections are nn.Linear (ModuleDict's items are typed as any Module)
            a = a + projected_noise(cast(nn.Linear, self.proj_u[mtype]).weight, a.shape, noise, generator)
            b = b + projected_noise(cast(nn.Linear, self.proj_v[mtype]).weight, b.shape, noise, generator)
        a = a * scale
        # (P_u u)(P_v v)ᵀ: a learned two-sided sketch of the rank-one term u vᵀ, invariant to (u, v) -> (-u, -v)
        outer = (a.unsqueeze(-1) * b.unsqueeze(-2)).flatten(-2)
        x = self.token(outer)
        # σ-weighted sum of the rank-one sketches: a learned linear sketch P_u dW P_vᵀ of the whole
        # module, normalized by the adapter's total ||dW||_F (what exact dW cosine compares)
        sigma = tok.log_sigma.exp() * tok.mask
        total = (tok.sigma_norms() if tok.norms is None else tok.norms).clamp_min(1e-12)
        weights = (sigma / total[:, None, None]).unsqueeze(-1)
        module_sketch = ((a * weights).transpose(-1, -2) @ b).flatten(-2)  # Σ_i σ_i a_i b_iᵀ / total: (B, M, k²)
        linear_sketch = self.sketch(module_sketch)  # (B, M, d)
        if self.gram is not None:
            grams = torch.cat(self.gram_sketches(a, b * tok.v.shape[-1] ** 0.5, tok), dim=-1)
            linear_sketch = linear_sketch + self.gram(grams)
            module_sketch = torch.cat([module_sketch, grams], dim=-1)
        ls = tok.log_sigma
        ls_max = ls.masked_fill(~tok.mask, float("-inf")).amax(dim=-1, keepdim=True).clamp_min(-30.0)
        rel = (ls - ls_max).masked_fill(~tok.mask, 0.0)
        gamma, beta = self.film(torch.stack([ls, rel], dim=-1)).chunk(2, dim=-1)
        x = x * (1 + gamma) + beta
        flat_mask = tok.mask.reshape(B * M, R)
        has_any = flat_mask.any(dim=-1)
        safe_mask = flat_mask | ~has_any[:, None]  # a fully padded module attends to itself, then is masked
        x = self.rank_encoder(x.reshape(B * M, R, -1), src_key_padding_mask=~safe_mask)
        pooled = self.rank_pool(x, flat_mask, prior=rel.reshape(B * M, R)).reshape(B, M, -1) + linear_sketch
        t = self.types.index(mtype)
        pooled = pooled + self.layer_emb(tok.layers.clamp(0, self.config.n_layers))[None] + self.type_emb.weight[t]
        return pooled, has_any.reshape(B, M), module_sketch

    @staticmethod
    def gram_sketches(a: torch.Tensor, b: torch.Tensor, tok: TypeTokens) -> tuple[torch.Tensor, torch.Tensor]:
        """(input, output) Gram sketches (B, M, k²) of each module from its projected components a = P_u u, b = P_v v
        (B, M, R, k): Σ_i s_i² b_i b_iᵀ and Σ_i s_i² a_i a_iᵀ, s_i² = σ_i² / Σ_module σ² (0 for a module not there)."""
        s2 = (tok.log_sigma.exp() * tok.mask).pow(2)
        w = (s2 / s2.sum(dim=-1, keepdim=True).clamp_min(1e-24)).unsqueeze(-1)
        return ((b * w).transpose(-1, -2) @ b).flatten(-2), ((a * w).transpose(-1, -2) @ a).flatten(-2)

    def forward(
        self, batch: Batch, noise: float = 0.0, generator: torch.Generator | None = None, readout_scale: float | torch.Tensor = 1.0
    ) -> torch.Tensor:
        """Adapter embeddings (B, embed_dim), not normalized. Training views: `noise`, N(0, noise²/width) on every u and v;
        `readout_scale`, the readout's input scaled by it (1/the share of the modules a view keeps), for all rows or per row (B,)."""
        x, mask, sketches = self._pooled_modules(batch, noise, generator)
        kept = mask.any(dim=0)  # module tokens no adapter of the batch has change nothing below: left out
        if bool(kept.any()) and not bool(kept.all()):
            x, mask = x[:, kept], mask[:, kept]
        safe = mask | ~mask.any(dim=-1, keepdim=True)
        x = self.module_encoder(x, src_key_padding_mask=~safe)
        z = self.out(self.module_pool(x, mask))
        if self.readout is not None:
            flat = sketches.flatten(1)
            if isinstance(readout_scale, torch.Tensor):
                flat = flat * readout_scale[:, None]
            elif readout_scale != 1.0:
                flat = flat * readout_scale
            z = z + self.readout(flat)
        return z

    def _pooled_modules(
        self, batch: Batch, noise: float, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(module tokens (B, G, d), mask (B, G), summed sketches (B, G, k²)): each group's mean token over the modules
        the adapter has, and its sketches' sum; with a group per module, the module tokens themselves."""
        first = next(iter(batch.values()))
        B, G, k2 = first.mask.shape[0], self.config.n_tokens, self.config.sketch_width
        device = first.mask.device
        x = torch.zeros(B, G, self.config.dim, device=device)
        count = torch.zeros(B, G, device=device)
        sketches = torch.zeros(B, G, k2, device=device)
        for t in self.types:
            if t not in batch:
                continue
            pooled, has_any, sketch = self.module_tokens(t, batch[t], noise, generator)
            groups = batch[t].groups
            present = has_any.to(pooled.dtype)
            x = x.index_add(1, groups, pooled * present[..., None])
            count = count.index_add(1, groups, present)
            sketches = sketches.index_add(1, groups, sketch)
        return x / count.clamp_min(1.0)[..., None], count > 0, sketches

    def predict(self, z: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(class logits per attribute, standardized regression outputs per metric)."""
        return {k: h(z) for k, h in self.heads.items()}, {k: r(z).squeeze(-1) for k, r in self.regressors.items()}
