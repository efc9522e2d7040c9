"""Training the W2T embedder: supervised multi-task heads, contrastive, or both.

Supervised: cross-entropy per categorical attribute known for the adapters, MSE on each
standardized measured metric. Contrastive: two views of every adapter (its weakest rank
components truncated, small noise on u and v); positives are the other view and, where the zoo
has them, adapters of the same task (supervised-contrastive loss). Early stopping on a
validation split; deterministic from the seed on the CPU.

An embedder is a small ensemble: `members` models trained from consecutive seeds, each
early-stopped on its own slice of the adapters, so the ensemble learns from all of them and most
adapters are held out by one or more members. Its embedding concatenates theirs (its
cosine is their mean cosine) and its class probabilities average theirs: one W2T model varies a
lot from seed to seed on a few hundred adapters. The search score and each target's predictor are
then chosen on the held-out slices, each adapter scored by the mean of the members that held it
out (embed/choice.py: the best expected quality, where choosing so pays on held-out halves).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from embed.choice import (
    Fold,
    choose_attribute,
    choose_metric,
    choose_search,
    knn_similarity,
    logistic_readout,
    mean_per_row,
    readout_predictions,
)
from embed.distill import distillation_loss, rotate_outputs, token_kernel
from embed.ensemble import W2TEnsemble, batch_rows
from embed.fitted import MAX_LABELLED, Purpose, fit_all, out_of_fold, unavailable
from embed.metrics import retrieval
from embed.model import W2T, W2TConfig
from embed.tokens import (
    MAX_MODULE_TOKENS,
    TOKEN_WIDTH,
    Batch,
    TokenSpec,
    TypeTokens,
    max_rank,
    module_groups,
    n_rows,
    select,
    to_device,
    token_shapes,
    tokenize,
    tokens_per_adapter,
    torch_threads,
)
from embed.types import SpaceSchema, ZooAdapter
from zoo.domain.channel_metric import Bank, bank_matrices
from zoo.domain.channels import EXACT_SCORES, exact_cosines
from zoo.domain.methods import HEAD, LOGREG, NEIGHBOURS
from zoo.domain.similarity import ModuleStack, dense_modules
from zoo.labels import TASK_KEY

#: an adapter's tokens at full width (float32 u and v) may take this much before its sides are projected (unless a
#: training names its width): the reference zoos' adapters (all-MiniLM-L6 at r16: 2.7 MB) keep every width, on
#: which their results were measured; one layer of Llama-3-8B at r16 (5.2 MB) is projected, all 32 take 168 MB
FULL_WIDTH_TOKEN_BYTES = 4 << 20
#: rank tokens an adapter brings to a training step (TrainOptions.step_rank_tokens): Llama-3-8B r16, 64 of its 224 modules
STEP_RANK_TOKENS = 1024


@dataclass
class TrainOptions:
    objective: str = "supervised"  # supervised | contrastive | both
    epochs: int = 80
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.05
    #: each member's held-out share (_folds), on which it early-stops and the choices are scored; each adapter is held
    #: out by about members × val_fraction members (0.75 by default: a quarter by none, the rest by one)
    val_fraction: float = 0.15
    patience: int = 15
    seed: int = 0
    dim: int = 32
    temperature: float = 0.1
    augment_sign_flips: bool = False  # harmless by construction: for measuring that
    augment_rank_permutations: bool = False
    augment_truncation: bool = True  # supervised views drop weak components and add small noise, as contrastive views do
    #: views rescale each adapter's update by e^c, c ~ U(-x, x) (its σ; the sketches are normalized and keep theirs): the
    #: update's scale (learning rate × alpha) says nothing of what the adapter does. 0: off
    augment_rescale: float = 0.0
    #: views drop up to this share of each adapter's modules (the share drawn per view, at least one module kept; the
    #: readout of the rest scaled up to match, as _module_view does). On shapes-cnn with 8 labels per task the chosen
    #: search gained 0.017 hit@1 and 0.029 nDCG@10 by it; with 4 it lost 0.003-0.007 (docs/results-history.md, issue 32,
    #: seventh round). Contrastive views drop modules too. 0: off
    augment_module_dropout: float = 0.5
    #: supervised steps replace this share of their labelled adapters by a mix λ dW + (1 − λ) dW′ with another training
    #: adapter of the same task (λ ~ U(0.25, 0.75)), canonicalized again and cut to the padded rank: a new adapter of
    #: that task, where labels are few. Its measured metrics are unknown. 0: off
    augment_mixup: float = 0.0
    #: `both` only: an epoch's contrastive rows are its labelled training adapters and a fresh draw of at most this many
    #: unlabelled ones per labelled one (validation: one fixed draw of the same share), so that the training's cost
    #: follows the labels, not the zoo. None: every adapter, every epoch
    unlabelled_per_labelled: float | None = None
    device: str | None = None
    metrics: tuple[str, ...] = ("test_accuracy",)
    #: attributes that get a classification head; None: every categorical attribute. Heads for the
    #: generating hyperparameters made the task embedding much worse on the reference zoo (docs/results-history.md).
    attributes: tuple[str, ...] | None = ("task",)
    dropout: float = 0.2
    #: models in the ensemble, trained from seeds seed, seed + 1, ... Ten with val_fraction 0.2 hold each adapter out
    #: of two, whose mean the choices score: better with scarce labels, worse with full ones, at twice the training
    #: (docs/results-history.md, issue 32, sixth round)
    members: int = 5
    #: u and v wider than this are projected to it (embed.tokens.TokenSpec, seeded by `seed`); 0: full width; None:
    #: full width while an adapter's tokens at full width take at most FULL_WIDTH_TOKEN_BYTES, else TOKEN_WIDTH
    token_width: int | None = None
    #: module tokens per adapter, at most (modules grouped by type and layer beyond it); 0: one per module
    max_module_tokens: int = MAX_MODULE_TOKENS
    #: rank tokens an adapter brings to a training step, at most: beyond it a step sees a random subset of the modules
    #: (_module_view; validation and embedding see them all); 0: every module
    step_rank_tokens: int = STEP_RANK_TOKENS
    #: second-order input and output Gram sketches per module beside the first-order one, into the module tokens and
    #: the readout (embed.model, W2TConfig.gram_sketches): a rotation of dW's output side leaves the input one unmoved
    gram_sketches: bool = False
    #: self-supervised epochs before the supervised ones, on every adapter, labelled or not (at most pretrain_adapters):
    #: the W2T cosine is taught to rank the adapters of a batch as an exact score does (embed.distill); the members
    #: then start from these weights. 0: none
    pretrain_epochs: int = 0
    #: the exact score pretraining distills: "dw", "module", "input_gram", or "auto": of those the one that retrieves
    #: the labelled adapters' tasks best (leave-one-out MRR + nDCG@10 among them; training-free, so no fold is needed)
    pretrain_score: str = "auto"
    #: pretraining views carry what a run's own seeds and settings change but its task does not: weak components cut,
    #: modules dropped (augment_module_dropout), dW rescaled by e^c, c ~ U(-1, 1), and, where the distilled score
    #: ignores the output side (the input Gram), the output side turned by a random orthogonal Q (a re-seeded head)
    pretrain_augment: bool = True
    #: the most adapters pretraining uses, drawn with the seed (its target kernel is their n × n exact scores)
    pretrain_adapters: int = 4096
    #: torch threads while training (None: torch's default). One: on a shared 2-core machine two threads wait on each
    #: other at every small op (a Llama-3-8B step was 2.6 times slower in wall time, docs/results.md)
    threads: int | None = 1
    #: the few-label channel metrics (embed/fitted.py) are candidates of the out-of-fold choices, where the space has
    #: their atoms; off: the training-free exact scores and W2T only (what `zoo eval` compares the default with)
    channel_metric: bool = True


def token_spec(options: TrainOptions, schema: SpaceSchema, rank: int) -> TokenSpec:
    """How the adapters of a training with these options are tokenized, in a space of this schema and padded rank."""
    width = options.token_width
    if width is None:
        full_bytes = 4 * rank * sum(o + i for _, o, i in schema.modules)  # float32 u and v of every component
        width = TOKEN_WIDTH if full_bytes > FULL_WIDTH_TOKEN_BYTES else 0
    return TokenSpec(width, options.seed, options.max_module_tokens)


@dataclass
class ExactScores:
    """The exact scores (zoo.domain.channels.EXACT_SCORES) among some training adapters, by id: what the out-of-fold
    choices compare W2T with. `source` says what they were computed from: "factors" (exact), or "module sketches"
    where the space is too big for the engine's module store, whose module-cosine estimate then stands in for both
    scores when a query is served (embed.engine) and so here. `bank`: the channel metric's atoms among them
    (zoo.domain.channel_metric.bank_matrices), from the factors, where they are at most embed.fitted.MAX_LABELLED."""

    ids: np.ndarray
    scores: dict[str, np.ndarray]
    source: str = "factors"
    bank: Bank | None = None

    def _at(self, ids: list[int]) -> np.ndarray:
        at = {int(i): j for j, i in enumerate(self.ids.tolist())}
        return np.array([at[int(i)] for i in ids], dtype=np.int64)

    def among(self, ids: list[int]) -> dict[str, np.ndarray]:
        idx = self._at(ids)
        return {k: v[np.ix_(idx, idx)] for k, v in self.scores.items()}

    def bank_among(self, ids: list[int]) -> Bank | None:
        idx = self._at(ids)
        return self.bank.take(idx, idx) if self.bank is not None else None

    @classmethod
    def of_stack(cls, ids: np.ndarray, stack: ModuleStack, bank: bool = True) -> ExactScores:
        """Exact scores among the adapters of a stack, and with `bank` the channel metric's atoms where they are few
        enough."""
        atoms = bank_matrices(stack, stack) if bank and stack.size <= MAX_LABELLED else None
        return cls(ids, {s: exact_cosines(stack, stack, s) for s in EXACT_SCORES}, bank=atoms)

    @classmethod
    def of_factors(cls, adapters: list[ZooAdapter], bank: bool = True) -> ExactScores:
        """Exact scores (and with `bank` the atoms: of_stack) among adapters held with their full factors."""
        factors = [a.factors for a in adapters]
        stack = ModuleStack.of(factors, dense_modules(factors))
        return cls.of_stack(np.array([a.id for a in adapters], dtype=np.int64), stack, bank)


def categorical_attributes(adapters: list[ZooAdapter]) -> dict[str, list[str]]:
    """Attributes worth a classification head: known for most of the labelled adapters (those with any label or
    measurement: a zoo may hold far more unlabelled ones), few distinct values, at least two examples per value
    on average."""
    keys = sorted({k for a in adapters for k in a.labels})
    labelled = sum(1 for a in adapters if a.labels or a.measurements)
    out = {}
    for key in keys:
        values = [a.labels[key] for a in adapters if key in a.labels]
        distinct = sorted(set(values))
        if len(values) >= 0.5 * labelled and 2 <= len(distinct) <= 64 and len(distinct) <= 0.5 * len(values):
            out[key] = distinct
    return out


def _module_view(tokens: Batch, rows: torch.Tensor, rank_tokens: int, gen: torch.Generator) -> tuple[Batch, float]:
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


#: a training view's noise on u and v: N(0, VIEW_NOISE² / width) per coordinate (added by the model, embed.model.projected_noise)
VIEW_NOISE = 0.02


def _augment(batch: Batch, gen: torch.Generator, options: TrainOptions, contrastive_view: bool) -> tuple[Batch, torch.Tensor | None]:
    """A training view's tokens: its weakest components dropped (the model adds the view's noise, VIEW_NOISE), and where the
    options ask, its scale changed and some of its modules dropped; with the per-row factor its readout is scaled by
    (None: 1). Sign flips of (u_i, v_i) are left out of views: the model is invariant to them, and they cost two passes
    over u and v."""
    rows = n_rows(batch)
    log_scale = None
    if contrastive_view and options.augment_rescale:
        log_scale = (2 * torch.rand(rows, generator=gen) - 1) * options.augment_rescale
    dropped, readout = _module_dropout(batch, gen, options.augment_module_dropout) if contrastive_view else ({}, None)
    out: Batch = {}
    for t, tok in batch.items():
        u, v, ls, mask = tok.u, tok.v, tok.log_sigma, tok.mask
        norms = tok.norms
        if t in dropped:  # the sketches stay normalized by the whole adapter's σ, as in _module_view
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


def _module_dropout(batch: Batch, gen: torch.Generator, share: float) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
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


def _mix_partners(rows: torch.Tensor, train: torch.Tensor, groups: torch.Tensor, share: float, gen: torch.Generator) -> torch.Tensor:
    """For each row: another of the `train` rows in its group (its task) to be mixed with, drawn at random, for a `share`
    of the rows that have one; -1 for the others."""
    out = torch.full_like(rows, -1)
    pick = torch.rand(len(rows), generator=gen) < share
    for i in torch.nonzero(pick).flatten().tolist():
        mates = train[(groups[train] == groups[rows[i]]) & (train != rows[i])]
        if len(mates):
            out[i] = mates[int(torch.randint(len(mates), (1,), generator=gen))]
    return out


def _mix(batch: Batch, mates: Batch, lam: torch.Tensor) -> Batch:
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


def _step_tokens(
    data: _Data, rows: torch.Tensor, train_rows: torch.Tensor, options: TrainOptions, gen: torch.Generator, train: bool
) -> tuple[Batch, Batch, float, torch.Tensor | None]:
    """A step's tokens of its rows (a module view of them in training), the tokens its supervised loss sees (some rows
    replaced by mixes with a mate of their task, where options.augment_mixup asks), the readout scale, and each row's
    mate (-1: none), or None where no row was mixed."""
    if not train:
        batch = select(data.tokens, rows)
        return batch, batch, 1.0, None
    mates = (
        _mix_partners(rows, train_rows, data.groups, options.augment_mixup, gen)
        if options.augment_mixup and options.objective != "contrastive"
        else None
    )
    if mates is None or not bool((mates >= 0).any()):
        batch, scale = _module_view(data.tokens, rows, options.step_rank_tokens, gen)
        return batch, batch, scale, None
    mixed = mates >= 0
    both, scale = _module_view(data.tokens, torch.cat([rows, mates[mixed]]), options.step_rank_tokens, gen)  # the same modules
    batch, mate_tokens = select(both, slice(0, len(rows))), select(both, slice(len(rows), None))
    lam = 0.25 + 0.5 * torch.rand(int(mixed.sum()), generator=gen)
    sup = {t: _copy(tok) for t, tok in batch.items()}
    for t, tok in _mix(select(batch, mixed), mate_tokens, lam).items():
        for name in ("u", "v", "log_sigma", "mask"):
            getattr(sup[t], name)[mixed] = getattr(tok, name)
        norms = sup[t].norms
        if tok.norms is not None and norms is not None:
            norms[mixed] = tok.norms
    return batch, sup, scale, mates


def _copy(tok: TypeTokens) -> TypeTokens:
    norms = None if tok.norms is None else tok.norms.clone()
    return TypeTokens(tok.u.clone(), tok.v.clone(), tok.log_sigma.clone(), tok.mask.clone(), tok.layers, tok.groups, norms)


def _readout_scale(scale: float, per_row: torch.Tensor | None, device: torch.device) -> float | torch.Tensor:
    """A view's readout factor: the module view's, times each row's where modules were dropped from it."""
    return scale if per_row is None else (per_row * scale).to(device)


def _supcon(z1: torch.Tensor, z2: torch.Tensor, groups: torch.Tensor, temperature: float) -> torch.Tensor:
    """Supervised-contrastive loss over 2B views; positives share a group (the same adapter or task)."""
    z = nn.functional.normalize(torch.cat([z1, z2]), dim=-1)
    g = torch.cat([groups, groups])
    sim = z @ z.T / temperature
    eye = torch.eye(len(z), dtype=torch.bool, device=z.device)
    sim = sim.masked_fill(eye, float("-inf"))
    pos = (g[:, None] == g[None, :]) & ~eye
    log_prob = sim - torch.logsumexp(sim, dim=1, keepdim=True)
    return -(log_prob.masked_fill(~pos, 0.0).sum(1) / pos.sum(1).clamp_min(1)).mean()


@dataclass
class _Data:
    """Everything training reads, tokenized once and shared by the members."""

    tokens: Batch
    targets: dict[str, torch.Tensor]
    reg_targets: dict[str, torch.Tensor]
    groups: torch.Tensor

    @property
    def has_target(self) -> torch.Tensor:
        """Per row: whether any supervised target (a class or a metric value) is known."""
        known = torch.zeros(len(self.groups), dtype=torch.bool)
        for y in self.targets.values():
            known |= y != -100
        for y in self.reg_targets.values():
            known |= ~torch.isnan(y)
        return known


@dataclass
class _Fold:
    """One member's split: it trains on `train` and early-stops on `val`."""

    train: torch.Tensor
    val: torch.Tensor


def _folds(n: int, members: int, options: TrainOptions) -> list[_Fold]:
    """Each member validates on val_fraction of the adapters: a run of one seeded permutation, the members' runs
    starting evenly spread over it. So the ensemble as a whole learns from every adapter, and each adapter is held
    out by members × val_fraction of them (the nearest whole numbers around it): one member's cosine, or several
    whose mean the out-of-fold choices score, as the served embedding averages all of theirs. Fewer than 10
    adapters: no validation."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(options.seed))
    n_val = min(max(1, int(round(options.val_fraction * n))), n - 1) if n >= 10 else 0
    out = []
    for i in range(members):
        val = (torch.arange(n_val) + i * n // members) % n
        rest = torch.ones(n, dtype=torch.bool)
        rest[val] = False
        out.append(_Fold(train=perm[rest], val=perm[val]))
    return out


def _train_member(
    config: W2TConfig,
    data: _Data,
    fold: _Fold,
    options: TrainOptions,
    seed: int,
    device: torch.device,
    desc: str,
    progress: bool,
    initial: dict[str, torch.Tensor] | None = None,
) -> tuple[W2T, list[dict[str, float]]]:
    """One model, early-stopped on its fold's validation loss, from `initial` weights where given (pretrained): (model,
    history)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = W2T(config).to(device)
    if initial is not None:
        model.load_state_dict(initial)
    opt = torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=options.weight_decay)

    has_target = data.has_target

    def loss_on(rows: torch.Tensor, train: bool) -> torch.Tensor:
        total = torch.zeros((), device=device)
        if options.objective == "supervised":  # only rows with a target count: the others are not forwarded at all
            rows = rows[has_target[rows]]
            if not len(rows):
                return total
        batch, sup_batch, scale, mates = _step_tokens(data, rows, fold.train, options, gen, train)
        contrastive: list[torch.Tensor] = []
        if options.objective in ("contrastive", "both"):
            views = [_augment(batch, gen, options, contrastive_view=True) for _ in range(2)]
            contrastive = [
                model(to_device(v, device), noise=VIEW_NOISE, generator=gen, readout_scale=_readout_scale(scale, f, device))
                for v, f in views
            ]
            total = total + _supcon(contrastive[0], contrastive[1], data.groups[rows].to(device), options.temperature)
        if options.objective in ("supervised", "both"):
            if contrastive and train and sup_batch is batch and options.augment_truncation:
                z = contrastive[0]  # a view drawn as the supervised one would be: its heads read it, one forward saved
            else:
                view, factor = (
                    _augment(sup_batch, gen, options, contrastive_view=options.augment_truncation) if train else (sup_batch, None)
                )
                noise = VIEW_NOISE if train and options.augment_truncation else 0.0
                z = model(to_device(view, device), noise=noise, generator=gen, readout_scale=_readout_scale(scale, factor, device))
            logits, reg = model.predict(z)
            for k, lg in logits.items():
                y = data.targets[k][rows]
                if mates is not None:  # a mix keeps the attributes its two adapters share
                    y = torch.where((mates >= 0) & (y != data.targets[k][mates.clamp_min(0)]), -100, y)
                y = y.to(device)
                if (y != -100).any():
                    total = total + nn.functional.cross_entropy(lg, y, ignore_index=-100)
            for k, out in reg.items():
                y = data.reg_targets[k][rows]
                if mates is not None:  # a mix's metrics were never measured
                    y = y.masked_fill(mates >= 0, float("nan"))
                y = y.to(device)
                ok = ~torch.isnan(y)
                if ok.any():
                    total = total + nn.functional.mse_loss(out[ok], y[ok])
        return total

    ratio = options.unlabelled_per_labelled if options.objective == "both" else None
    val_rows = _rows_for_epoch(fold.val, has_target, ratio, torch.Generator().manual_seed(seed))
    n_val = len(val_rows)
    size = batch_rows(tokens_per_adapter(data.tokens), options.batch_size)
    best, best_state, stale = math.inf, copy.deepcopy(model.state_dict()), 0
    history: list[dict[str, float]] = []
    bar = tqdm(range(options.epochs), desc=desc, unit="epoch", disable=not progress)
    for epoch in bar:
        model.train()
        rows_now = _rows_for_epoch(fold.train, has_target, ratio, gen)
        order = rows_now[torch.randperm(len(rows_now), generator=gen)]
        train_loss = 0.0
        for start in range(0, len(order), size):
            rows = order[start : start + size]
            if len(rows) < 2:
                continue
            loss = loss_on(rows, train=True)
            if not loss.requires_grad:  # nothing known about these adapters for this objective
                continue
            opt.zero_grad()
            loss.backward()
            opt.step()
            train_loss += float(loss.detach()) * len(rows)
        model.eval()
        with torch.no_grad():
            val_loss = (
                _val_loss(loss_on, val_rows, batch_rows(tokens_per_adapter(data.tokens), n_val))
                if n_val >= 2
                else train_loss / max(1, len(order))
            )
        history.append({"epoch": epoch, "train_loss": train_loss / max(1, len(order)), "val_loss": val_loss})
        bar.set_postfix(val=f"{val_loss:.3f}")
        if val_loss < best - 1e-4:
            best, best_state, stale = val_loss, copy.deepcopy(model.state_dict()), 0
        else:
            stale += 1
            if stale >= options.patience:
                break
    model.load_state_dict(best_state)
    model.eval()
    return model, history


#: pretraining views rescale dW by e^c, c ~ U(-PRETRAIN_RESCALE, PRETRAIN_RESCALE)
PRETRAIN_RESCALE = 1.0
#: multiply-adds the pretraining target may take (n² pairs × modules × rank² × width): fewer adapters are drawn where
#: pretrain_adapters of them would take more (300 digits-vit adapters: 6·10¹⁰; at Llama-3-8B r16, projected: 101 adapters)
PRETRAIN_KERNEL_MACS = 3 * 10**11


def pretraining_rows(tokens: Batch, most: int) -> int:
    """How many adapters pretraining draws: at most `most`, and as many as PRETRAIN_KERNEL_MACS allows (at least 2)."""
    per_pair = sum(int(t.mask.shape[1] * t.mask.shape[2] ** 2 * (t.u.shape[-1] + t.v.shape[-1])) for t in tokens.values())
    return max(2, min(most, n_rows(tokens), math.isqrt(PRETRAIN_KERNEL_MACS // max(1, per_pair))))


def favoured_score(tokens: Batch, tasks: list[str]) -> str:
    """The exact score (dw, module, input_gram) that retrieves the tasks best among the rows with one: each queries
    the others, scored by MRR + nDCG@10; dW cosine where fewer than two rows have a task."""
    rows = [r for r, t in enumerate(tasks) if t]
    if len(rows) < 2:
        return "dw"
    labelled = select(tokens, torch.tensor(rows))
    labels = [tasks[r] for r in rows]
    quality = {}
    for score in ("dw", "module", "input_gram"):
        got = retrieval(token_kernel(labelled, score).numpy(), labels, labels, list(range(len(rows))))
        quality[score] = got["mrr"] + got["ndcg@10"]
    return max(quality, key=lambda s: quality[s])


#: pretrained weights and the record of how they were made (embed.train.pretrain)
Pretrained = tuple[dict[str, torch.Tensor], dict[str, object]]


def pretrain(
    config: W2TConfig, tokens: Batch, tasks: list[str], options: TrainOptions, device: torch.device, progress: bool = False
) -> Pretrained:
    """Self-supervised pretraining on the rows of `tokens` (at most options.pretrain_adapters of them and
    PRETRAIN_KERNEL_MACS' worth, drawn with the seed), labelled or not: options.pretrain_epochs epochs of the
    distillation loss (embed.distill) between the W2T cosines of a batch and the exact score options.pretrain_score
    among its adapters (`tasks`, "" where unknown, pick it where "auto"). (weights, what was done: score, epochs,
    views, the mean loss on plain views before and after)."""
    torch.manual_seed(options.seed)
    gen = torch.Generator().manual_seed(options.seed)
    rows = torch.randperm(n_rows(tokens), generator=gen)[: pretraining_rows(tokens, options.pretrain_adapters)].sort().values
    tokens = select(tokens, rows)
    score = favoured_score(tokens, [tasks[r] for r in rows.tolist()]) if options.pretrain_score == "auto" else options.pretrain_score
    kernel = token_kernel(tokens, score).float()
    model = W2T(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=options.weight_decay)
    size = batch_rows(tokens_per_adapter(tokens), options.batch_size)
    views = replace(options, augment_rescale=PRETRAIN_RESCALE)
    rotate = options.pretrain_augment and score == "input_gram"
    before = _distillation_on(model, tokens, kernel, size, options.temperature, device)
    bar = tqdm(range(options.pretrain_epochs), desc=f"pretrain w2t (distil {score})", unit="epoch", disable=not progress)
    for _ in bar:
        model.train()
        order = torch.randperm(len(rows), generator=gen)
        for start in range(0, len(order), size):
            idx = order[start : start + size]
            if len(idx) < 2:
                continue
            batch, scale = _module_view(tokens, idx, options.step_rank_tokens, gen)
            factor, noise = None, 0.0
            if options.pretrain_augment:
                batch, factor = _augment(batch, gen, views, contrastive_view=True)
                batch = rotate_outputs(batch, gen) if rotate else batch
                noise = VIEW_NOISE
            z = model(to_device(batch, device), noise=noise, generator=gen, readout_scale=_readout_scale(scale, factor, device))
            loss = distillation_loss(z, kernel[idx][:, idx], options.temperature)
            opt.zero_grad()
            loss.backward()
            opt.step()
    after = _distillation_on(model, tokens, kernel, size, options.temperature, device)
    info: dict[str, object] = {
        "score": score,
        "epochs": options.pretrain_epochs,
        "adapters": len(rows),
        "augment": options.pretrain_augment,
        "rotate_outputs": rotate,
        "loss_before": before,
        "loss_after": after,
    }
    return copy.deepcopy(model.state_dict()), info


@torch.no_grad()
def _distillation_on(model: W2T, tokens: Batch, kernel: torch.Tensor, size: int, temperature: float, device: torch.device) -> float:
    """The mean distillation loss of plain views over consecutive batches of `size` rows (a fixed measure for
    before and after)."""
    model.eval()
    n = n_rows(tokens)
    parts = []
    for start in range(0, n, size):
        idx = torch.arange(start, min(n, start + size))
        if len(idx) >= 2:
            z = model(to_device(select(tokens, idx), device))
            parts.append(float(distillation_loss(z, kernel[idx][:, idx], temperature)))
    return sum(parts) / max(1, len(parts))


def _rows_for_epoch(rows: torch.Tensor, has_target: torch.Tensor, ratio: float | None, gen: torch.Generator) -> torch.Tensor:
    """The rows an epoch trains (or validates) on: every labelled one and at most `ratio` unlabelled ones per labelled
    one, drawn with `gen` (None, or no labelled row: all of them)."""
    labelled = has_target[rows]
    if ratio is None or not bool(labelled.any()):
        return rows
    unlabelled = rows[~labelled]
    keep = min(len(unlabelled), math.ceil(ratio * int(labelled.sum())))
    drawn = unlabelled[torch.randperm(len(unlabelled), generator=gen)[:keep]].sort().values
    return torch.cat([rows[labelled], drawn])


def _val_loss(loss_on: Callable[..., torch.Tensor], rows: torch.Tensor, size: int) -> float:
    """The validation loss of the rows, in batches of at most `size` (one batch, as before, where they fit in one)."""
    if len(rows) <= size:
        return float(loss_on(rows, train=False))
    parts = [(float(loss_on(rows[s : s + size], train=False)), len(rows[s : s + size])) for s in range(0, len(rows), size)]
    return sum(loss * n for loss, n in parts) / len(rows)


def _seconds_per_epoch(config: W2TConfig, data: _Data, fold: _Fold, options: TrainOptions, device: torch.device) -> float:
    """Wall seconds of one training epoch here and now, measured on a throwaway model (the estimate `zoo train`
    prints before it starts)."""
    t0 = time.perf_counter()
    _train_member(config, data, fold, replace(options, epochs=1), options.seed, device, "", progress=False)
    return time.perf_counter() - t0


def _duration(seconds: float) -> str:
    """A human duration: `45 s`, `3 min 20 s`."""
    seconds = round(seconds)
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60} s"


def train_w2t(
    adapters: list[ZooAdapter],
    schema: SpaceSchema,
    options: TrainOptions,
    progress: bool = True,
    tokens: Batch | None = None,
    exact: ExactScores | None = None,
    pretrained: Pretrained | None = None,
) -> W2TEnsemble:
    """Train on `adapters`: each member early-stops on its own held-out slice, which also scores the choices.

    The adapters' tokens are made from their factors (full width), or given: `tokens`, made with `token_spec(options, schema, rank)`
    (embed.dataset.read_training_set projects them as it reads the adapters, which then need no factors), with the
    exact scores among the labelled adapters in `exact` (computed from the factors where not given). `pretrained`: what
    `pretrain` made of these adapters with a config of these options (w2t_config), for trainings that share one
    (pretraining reads no label where options.pretrain_score is fixed); None: pretrain here where the options ask."""
    if tokens is not None and exact is None:
        raise ValueError("adapters given as tokens need their exact scores (ExactScores): their factors may be projected")
    with torch_threads(options.threads):
        return _train_w2t(adapters, schema, options, progress, tokens, exact, pretrained)


def w2t_config(adapters: list[ZooAdapter], schema: SpaceSchema, options: TrainOptions, rank: int) -> W2TConfig:
    """The model a training with these options makes for these adapters (its heads: their attributes and metrics)."""
    categorical = categorical_attributes(adapters) if options.objective != "contrastive" else {}
    if options.attributes is not None:
        categorical = {k: v for k, v in categorical.items() if k in options.attributes}
    metrics = [m for m in options.metrics if any(m in a.measurements for a in adapters)] if options.objective != "contrastive" else []
    spec = token_spec(options, schema, rank)
    return W2TConfig(
        type_shapes=schema.type_shapes(),
        n_layers=max(schema.layer_of(n) for n in schema.module_names) + 1,
        n_modules=len(schema.modules),
        dim=options.dim,
        embed_dim=options.dim,
        dropout=options.dropout,
        categorical=categorical,
        regression=metrics,
        token_width=spec.width,
        projection_seed=spec.seed,
        max_module_tokens=spec.max_module_tokens,
        module_groups=module_groups(schema, spec.max_module_tokens)[1] if spec.max_module_tokens else 0,
        gram_sketches=options.gram_sketches,
    )


def _train_w2t(
    adapters: list[ZooAdapter],
    schema: SpaceSchema,
    options: TrainOptions,
    progress: bool,
    tokens: Batch | None,
    exact: ExactScores | None,
    pretrained: Pretrained | None,
) -> W2TEnsemble:
    device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rank = max_rank(adapters) if tokens is None else next(iter(tokens.values())).mask.shape[-1]
    config = w2t_config(adapters, schema, options, rank)
    categorical, metrics, spec = config.categorical, config.regression, config.tokens
    stats, ranges = {}, {}
    for m in metrics:
        vals = np.array([a.measurements[m] for a in adapters if m in a.measurements])
        stats[m] = (float(vals.mean()), float(vals.std() or 1.0))
        ranges[m] = (float(vals.min()), float(vals.max()))
    if tokens is None:
        tokens = tokenize(adapters, schema, rank, spec)
    _check_tokens(tokens, schema, spec, len(adapters))
    n = len(adapters)
    task_values = sorted({a.labels.get(TASK_KEY, "") for a in adapters})
    data = _Data(
        tokens=tokens,
        targets={
            k: torch.tensor([classes.index(a.labels[k]) if k in a.labels else -100 for a in adapters]) for k, classes in categorical.items()
        },
        reg_targets={
            m: torch.tensor([(a.measurements[m] - stats[m][0]) / stats[m][1] if m in a.measurements else float("nan") for a in adapters])
            for m in metrics
        },
        groups=torch.tensor(
            [task_values.index(a.labels[TASK_KEY]) if TASK_KEY in a.labels else len(task_values) + i for i, a in enumerate(adapters)]
        ),
    )
    members = max(1, options.members)
    folds = _folds(n, members, options)
    if pretrained is None and options.pretrain_epochs:
        pretrained = pretrain(config, tokens, [a.labels.get(TASK_KEY, "") for a in adapters], options, device, progress)
    initial = None
    if pretrained is not None:
        initial, info = pretrained
        config = replace(config, pretraining=info)
    if progress:
        per_epoch = _seconds_per_epoch(config, data, folds[0], options, device)
        tqdm.write(
            f"W2T ({options.objective}): {members} models × up to {options.epochs} epochs on {n} adapters, "
            f"about {_duration(per_epoch * members * options.epochs)} here ({per_epoch:.2f} s an epoch; each model stops "
            f"early once its validation loss has not improved for {options.patience} epochs)"
        )
    models, history = [], []
    for i, fold in enumerate(folds):
        desc = f"train w2t ({options.objective}, model {i + 1}/{members})"
        model, member_history = _train_member(config, data, fold, options, options.seed + i, device, desc, progress, initial)
        models.append(model)
        history += [{"member": i, **h} for h in member_history]
    embedder = W2TEnsemble(models, schema, rank, stats, options.objective, history, metric_range=ranges)
    remember_and_choose(embedder, adapters, options, tokens, exact)
    return embedder


def _check_tokens(tokens: Batch, schema: SpaceSchema, spec: TokenSpec, n: int) -> None:
    widths = token_shapes(schema, spec)
    got = {t: (int(tok.u.shape[-1]), int(tok.v.shape[-1])) for t, tok in tokens.items()}
    if got != widths or n_rows(tokens) != n:
        raise ValueError(f"tokens of {n_rows(tokens)} adapters with widths {got}, not of {n} with {widths}")


def remember_and_choose(
    embedder: W2TEnsemble, adapters: list[ZooAdapter], options: TrainOptions, tokens: Batch | None = None, exact: ExactScores | None = None
) -> None:
    """A trained ensemble's memory (its labelled training adapters) and its out-of-fold choices, from the adapters
    it trained on (in the same order; or their tokens and exact scores, see train_w2t) and the options it trained
    with (which fix each member's fold)."""
    models, config, e = embedder.models, embedder.config, embedder
    singles = [W2TEnsemble([m], e.schema, e.rank, e.metric_stats, e.objective, metric_range=e.metric_range) for m in models]
    if tokens is None:
        tokens = tokenize(adapters, e.schema, e.rank, config.tokens)
    member_z = [single._forward_batches(single._token_batches(tokens))[0] for single in singles]
    z = np.concatenate(member_z, axis=1) / math.sqrt(len(models))  # what embedder.embed gives, without a second pass
    categorical, metrics = config.categorical, config.regression
    known = [r for r, a in enumerate(adapters) if any(k in a.labels for k in categorical) or any(m in a.measurements for m in metrics)]
    embedder.memory, embedder.memory_ids = z[known], np.array([adapters[r].id for r in known], dtype=np.int64)
    embedder.memory_values = {m: np.array([adapters[r].measurements.get(m, np.nan) for r in known]) for m in metrics}
    embedder.memory_labels = {k: [adapters[r].labels.get(k, "") for r in known] for k in categorical}
    embedder.predictors, embedder.choices, embedder.readouts, embedder.residual_std = {}, {}, {}, {}
    embedder.calibration, embedder._memory_classes, embedder.channel_metrics = {}, {}, {}
    folds = _folds(len(adapters), len(models), options)
    if len(folds[0].val) >= 2 and embedder.objective != "contrastive":  # choices made out of fold
        labelled = [adapters[r] for r in known]
        ids = [a.id for a in labelled]
        given = exact if exact is not None else ExactScores.of_factors(labelled, bank=options.channel_metric)
        why_not = unavailable(given.bank, given.source, len(labelled)) if options.channel_metric else "no channel metric: left out"
        bank = given.bank_among(ids) if why_not is None else None
        _choose(embedder, labelled, known, singles, member_z, folds, tokens, given.among(ids), bank, why_not)


def _choose(
    embedder: W2TEnsemble,
    labelled: list[ZooAdapter],
    rows: list[int],
    singles: list[W2TEnsemble],
    member_z: list[np.ndarray],
    folds: list[_Fold],
    tokens: Batch,
    exact: dict[str, np.ndarray],
    bank: Bank | None,
    why_not: str | None,
) -> None:
    """The search score and each target's predictor, out of fold (embed/choice.py), over the labelled adapters
    (`labelled`, at `rows` of the training set), among candidates that include the channel metrics (embed/fitted.py)
    where `bank` holds their atoms (else `why_not` says why not); the metrics fitted on every labelled adapter; and the
    std of the chosen metric predictors' residuals there."""
    at = {r: i for i, r in enumerate(rows)}
    views = [
        Fold([at[r] for r in f.val.tolist() if r in at], [at[r] for r in f.train.tolist() if r in at], mz[rows])
        for f, mz in zip(folds, member_z, strict=True)
    ]
    tasks = [a.labels.get(TASK_KEY, "") for a in labelled]
    if bank is not None:
        purposes = {
            "search": Purpose("search", tasks),
            **{k: Purpose("task", embedder.memory_labels[k]) for k in embedder.config.categorical},
            **{m: Purpose("performance", embedder.memory_values[m]) for m in embedder.config.regression},
        }
        exact = {**exact, **out_of_fold(bank, purposes, views)}
        embedder.channel_metrics = fit_all(bank, purposes)
    search = choose_search(exact, tasks, views)
    embedder.search = search.chosen
    similarity = knn_similarity(search.chosen)
    if why_not is not None:  # said where `zoo train` reports the search chosen
        search.reason = f"{search.reason}; {why_not}"
    embedder.choices = {"search": search.as_dict()}
    # each member predicts the rows it never trained on; a row held out by several is given their mean
    held_shares: dict[str, list[tuple[int, np.ndarray]]] = {}  # the heads' class shares by attribute, with their rows
    held_values: dict[str, list[tuple[int, np.ndarray]]] = {}  # the heads' values by metric, and the W2T kNN's ("neighbours.m")
    for single, view in zip(singles, views, strict=True):
        if not view.val:  # this member held out none of the labelled adapters
            continue
        _, probs, heads = single._forward_batches(single._token_batches(tokens, [rows[i] for i in view.val]))
        for k, p in probs.items():
            held_shares.setdefault(k, []).extend(zip(view.val, p, strict=True))
        for m, v in heads.items():
            single.memory = view.z[view.train]
            single.memory_values = {m: embedder.memory_values[m][view.train]}
            nbrs = single.neighbour_values(view.z[view.val], m) if not np.isnan(single.memory_values[m]).all() else v
            held_values.setdefault(m, []).extend(zip(view.val, v, strict=True))
            held_values.setdefault(f"neighbours.{m}", []).extend(zip(view.val, nbrs, strict=True))
    shares = {k: mean_per_row(pairs) for k, pairs in held_shares.items()}
    values = {m: {r: float(v) for r, v in mean_per_row(pairs).items()} for m, pairs in held_values.items()}
    for k in embedder.config.categorical:
        labels, classes = embedder.memory_labels[k], embedder.config.categorical[k]
        learned = {HEAD: shares.get(k, {}), **readout_predictions(labels, classes, views)}
        choice, _, embedder.calibration[k] = choose_attribute(exact, similarity, labels, classes, learned, views, k)
        embedder.predictors[k] = choice.chosen
        embedder.choices[k] = choice.as_dict()
        if choice.chosen == LOGREG:
            model = logistic_readout(embedder.memory, labels)
            embedder.readouts[k] = {"classes": list(model.classes_), "coef": model.coef_.tolist(), "intercept": model.intercept_.tolist()}  # type: ignore[attr-defined]
    for m in embedder.config.regression:
        predicted = {HEAD: values.get(m, {}), NEIGHBOURS: values.get(f"neighbours.{m}", {})}
        choice, pred, truth = choose_metric(exact, similarity, embedder.memory_values[m], predicted, views, m)
        embedder.predictors[m] = choice.chosen
        embedder.choices[m] = choice.as_dict()
        if len(truth) >= 2:
            embedder.residual_std[m] = float(np.std(embedder.clip(m, pred) - truth))
