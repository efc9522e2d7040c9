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
out (embed/selection/choice.py: the best expected quality, where choosing so pays on held-out halves).
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

from embed.data.dataset import ExactScores
from embed.data.tokens import (
    Batch,
    TokenSpec,
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
from embed.data.types import SpaceSchema, ZooAdapter
from embed.selection.choice import (
    Fold,
)
from embed.selection.fitted import unavailable
from embed.training.ensemble_choices import choose_methods
from embed.training.pretrain import Pretrained, pretrain
from embed.training.train_options import TrainOptions, token_spec
from embed.training.views import VIEW_NOISE, augment, copy_tokens, mix, mix_partners, module_view, readout_scale
from embed.w2t.ensemble import W2TEnsemble, batch_rows
from embed.w2t.model import W2T, W2TConfig
from zoo.labels import TASK_KEY


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
        mix_partners(rows, train_rows, data.groups, options.augment_mixup, gen)
        if options.augment_mixup and options.objective != "contrastive"
        else None
    )
    if mates is None or not bool((mates >= 0).any()):
        batch, scale = module_view(data.tokens, rows, options.step_rank_tokens, gen)
        return batch, batch, scale, None
    mixed = mates >= 0
    both, scale = module_view(data.tokens, torch.cat([rows, mates[mixed]]), options.step_rank_tokens, gen)  # the same modules
    batch, mate_tokens = select(both, slice(0, len(rows))), select(both, slice(len(rows), None))
    lam = 0.25 + 0.5 * torch.rand(int(mixed.sum()), generator=gen)
    sup = {t: copy_tokens(tok) for t, tok in batch.items()}
    for t, tok in mix(select(batch, mixed), mate_tokens, lam).items():
        for name in ("u", "v", "log_sigma", "mask"):
            getattr(sup[t], name)[mixed] = getattr(tok, name)
        norms = sup[t].norms
        if tok.norms is not None and norms is not None:
            norms[mixed] = tok.norms
    return batch, sup, scale, mates


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


def member_folds(n: int, members: int, options: TrainOptions) -> list[_Fold]:
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
            views = [augment(batch, gen, options, contrastive_view=True) for _ in range(2)]
            contrastive = [
                model(to_device(v, device), noise=VIEW_NOISE, generator=gen, readout_scale=readout_scale(scale, f, device))
                for v, f in views
            ]
            total = total + _supcon(contrastive[0], contrastive[1], data.groups[rows].to(device), options.temperature)
        if options.objective in ("supervised", "both"):
            if contrastive and train and sup_batch is batch and options.augment_truncation:
                z = contrastive[0]  # a view drawn as the supervised one would be: its heads read it, one forward saved
            else:
                view, factor = augment(sup_batch, gen, options, contrastive_view=options.augment_truncation) if train else (sup_batch, None)
                noise = VIEW_NOISE if train and options.augment_truncation else 0.0
                z = model(to_device(view, device), noise=noise, generator=gen, readout_scale=readout_scale(scale, factor, device))
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
    val_rows = rows_for_epoch(fold.val, has_target, ratio, torch.Generator().manual_seed(seed))
    n_val = len(val_rows)
    size = batch_rows(tokens_per_adapter(data.tokens), options.batch_size)
    best, best_state, stale = math.inf, copy.deepcopy(model.state_dict()), 0
    history: list[dict[str, float]] = []
    bar = tqdm(range(options.epochs), desc=desc, unit="epoch", disable=not progress)
    for epoch in bar:
        model.train()
        rows_now = rows_for_epoch(fold.train, has_target, ratio, gen)
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


def rows_for_epoch(rows: torch.Tensor, has_target: torch.Tensor, ratio: float | None, gen: torch.Generator) -> torch.Tensor:
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
    (embed.data.dataset.read_training_set projects them as it reads the adapters, which then need no factors), with the
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
    folds = member_folds(n, members, options)
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
    embedder.memory_profiles = np.zeros((0, 1))
    embedder.predictors, embedder.choices, embedder.readouts, embedder.residual_std, embedder.trend_slopes = {}, {}, {}, {}, {}
    embedder.calibration, embedder._memory_classes, embedder.channel_metrics, embedder.gram_reference = {}, {}, {}, None
    folds = member_folds(len(adapters), len(models), options)
    if len(folds[0].val) >= 2 and embedder.objective != "contrastive":  # choices made out of fold
        labelled = [adapters[r] for r in known]
        ids = [a.id for a in labelled]
        given = exact if exact is not None else ExactScores.of_factors(labelled, bank=options.channel_metric, space=adapters)
        embedder.gram_reference = given.gram_reference
        embedder.memory_profiles = given.profiles_among(ids)
        why_not = unavailable(given.bank, given.source, len(labelled)) if options.channel_metric else "no channel metric: left out"
        bank = given.bank_among(ids) if why_not is None else None
        at = {r: i for i, r in enumerate(known)}
        views = [
            Fold([at[r] for r in f.val.tolist() if r in at], [at[r] for r in f.train.tolist() if r in at], mz[known])
            for f, mz in zip(folds, member_z, strict=True)
        ]
        choose_methods(embedder, labelled, known, singles, views, tokens, given.among(ids), bank, why_not)
