"""Training the W2T embedder: supervised multi-task heads, contrastive, or both.

Supervised: cross-entropy per categorical attribute known for the adapters, MSE on each
standardized measured metric. Contrastive: two views of every adapter (its weakest rank
components truncated, small noise on u and v); positives are the other view and, where the zoo
has them, adapters of the same task (supervised-contrastive loss). Early stopping on a
validation split; deterministic from the seed on the CPU.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from embed.dataset import SpaceSchema, ZooAdapter
from embed.metrics import retrieval
from embed.model import W2T, W2TConfig
from embed.similarity import hybrid_score, module_cosine_matrix
from embed.tokens import Batch, TypeTokens, max_rank, select, to_device, tokenize
from zoo.labels import TASK_KEY


@dataclass
class TrainOptions:
    objective: str = "supervised"  # supervised | contrastive | both
    epochs: int = 80
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.05
    val_fraction: float = 0.15
    patience: int = 15
    seed: int = 0
    dim: int = 32
    temperature: float = 0.1
    augment_sign_flips: bool = False  # harmless by construction: for measuring that
    augment_rank_permutations: bool = False
    augment_truncation: bool = True  # supervised views drop weak components and add small noise, as contrastive views do
    device: str | None = None
    metrics: tuple[str, ...] = ("test_accuracy",)
    #: attributes that get a classification head; None: every categorical attribute. Heads for the
    #: generating hyperparameters made the task embedding much worse on the reference zoo (docs/results.md).
    attributes: tuple[str, ...] | None = ("task",)
    dropout: float = 0.2


def categorical_attributes(adapters: list[ZooAdapter]) -> dict[str, list[str]]:
    """Attributes worth a classification head: known for most adapters, few distinct values."""
    keys = sorted({k for a in adapters for k in a.labels})
    out = {}
    for key in keys:
        values = [a.labels[key] for a in adapters if key in a.labels]
        distinct = sorted(set(values))
        if len(values) >= 0.5 * len(adapters) and 2 <= len(distinct) <= 64 and len(distinct) <= 0.25 * len(values):
            out[key] = distinct
    return out


@dataclass
class Embedder:
    """A trained W2T model with everything needed to embed and predict new adapters."""

    model: W2T
    schema: SpaceSchema
    rank: int
    metric_stats: dict[str, tuple[float, float]]
    objective: str
    history: list[dict[str, float]] = field(default_factory=list)
    #: per metric: std of (predicted - measured) on the validation adapters, for prediction intervals
    residual_std: dict[str, float] = field(default_factory=dict)
    #: per metric: (min, max) over the training adapters; predictions and intervals stay inside it
    metric_range: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: weight of this embedding's cosine against module cosine in the hybrid search score, chosen on the validation adapters
    hybrid_weight: float = 0.5

    def _batches(self, adapters: list[ZooAdapter], size: int = 256):  # type: ignore[no-untyped-def]
        for start in range(0, len(adapters), size):
            yield tokenize(adapters[start : start + size], self.schema, self.rank)

    @torch.no_grad()
    def embed(self, adapters: list[ZooAdapter]) -> np.ndarray:
        self.model.eval()
        device = next(self.model.parameters()).device
        parts = [self.model(to_device(b, device)).cpu() for b in self._batches(adapters)]
        z = torch.cat(parts) if parts else torch.zeros(0, self.model.config.embed_dim)
        return nn.functional.normalize(z, dim=-1).numpy()

    @torch.no_grad()
    def predict(self, adapters: list[ZooAdapter]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(class probabilities per attribute, predicted metric values in their own units)."""
        self.model.eval()
        device = next(self.model.parameters()).device
        probs: dict[str, list[torch.Tensor]] = {k: [] for k in self.model.config.categorical}
        values: dict[str, list[torch.Tensor]] = {k: [] for k in self.model.config.regression}
        for b in self._batches(adapters):
            logits, reg = self.model.predict(self.model(to_device(b, device)))
            for k, v in logits.items():
                probs[k].append(torch.softmax(v, dim=-1).cpu())
            for k, v in reg.items():
                mean, std = self.metric_stats[k]
                low, high = self.metric_range.get(k, (-math.inf, math.inf))
                values[k].append((v.cpu() * std + mean).clamp(low, high))
        return {k: torch.cat(v).numpy() for k, v in probs.items()}, {k: torch.cat(v).numpy() for k, v in values.items()}

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()}, str(directory / "model.safetensors"))
        meta = {
            "config": self.model.config.as_dict(),
            "schema": self.schema.as_dict(),
            "rank": self.rank,
            "metric_stats": self.metric_stats,
            "objective": self.objective,
            "history": self.history,
            "residual_std": self.residual_std,
            "metric_range": self.metric_range,
            "hybrid_weight": self.hybrid_weight,
        }
        (directory / "embedder.json").write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, directory: Path, device: str | None = None) -> Embedder:
        meta = json.loads((directory / "embedder.json").read_text())
        model = W2T(W2TConfig.from_dict(meta["config"]))
        model.load_state_dict(load_file(str(directory / "model.safetensors")))
        model.to(torch.device(device or "cpu"))
        stats = {k: (float(v[0]), float(v[1])) for k, v in meta["metric_stats"].items()}
        ranges = {k: (float(v[0]), float(v[1])) for k, v in meta.get("metric_range", {}).items()}
        schema = SpaceSchema.from_dict(meta["schema"])
        return cls(
            model, schema, int(meta["rank"]), stats, meta["objective"], meta["history"], meta["residual_std"], ranges, meta["hybrid_weight"]
        )


def _augment(batch: Batch, gen: torch.Generator, options: TrainOptions, contrastive_view: bool) -> Batch:
    out: Batch = {}
    for t, tok in batch.items():
        u, v, ls, mask = tok.u, tok.v, tok.log_sigma, tok.mask
        if options.augment_sign_flips or contrastive_view:
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
            u = u + 0.02 * torch.randn(u.shape, generator=gen) / math.sqrt(u.shape[-1])
            v = v + 0.02 * torch.randn(v.shape, generator=gen) / math.sqrt(v.shape[-1])
            ls = ls.masked_fill(~mask, 0.0)
        out[t] = TypeTokens(u, v, ls, mask, tok.layers)
    return out


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


def train_w2t(adapters: list[ZooAdapter], schema: SpaceSchema, options: TrainOptions, progress: bool = True) -> Embedder:
    """Train on `adapters` (a validation split is held out of them for early stopping)."""
    torch.manual_seed(options.seed)
    gen = torch.Generator().manual_seed(options.seed)
    device = torch.device(options.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    categorical = categorical_attributes(adapters) if options.objective != "contrastive" else {}
    if options.attributes is not None:
        categorical = {k: v for k, v in categorical.items() if k in options.attributes}
    metrics = [m for m in options.metrics if any(m in a.measurements for a in adapters)] if options.objective != "contrastive" else []
    stats, ranges = {}, {}
    for m in metrics:
        vals = np.array([a.measurements[m] for a in adapters if m in a.measurements])
        stats[m] = (float(vals.mean()), float(vals.std() or 1.0))
        ranges[m] = (float(vals.min()), float(vals.max()))
    rank = max_rank(adapters)
    config = W2TConfig(
        type_shapes=schema.type_shapes(),
        n_layers=max(schema.layer_of(n) for n in schema.module_names) + 1,
        n_modules=len(schema.modules),
        dim=options.dim,
        embed_dim=options.dim,
        dropout=options.dropout,
        categorical=categorical,
        regression=metrics,
    )
    model = W2T(config).to(device)
    tokens = tokenize(adapters, schema, rank)
    n = len(adapters)
    targets = {
        k: torch.tensor([classes.index(a.labels[k]) if k in a.labels else -100 for a in adapters]) for k, classes in categorical.items()
    }
    reg_targets = {
        m: torch.tensor([(a.measurements[m] - stats[m][0]) / stats[m][1] if m in a.measurements else float("nan") for a in adapters])
        for m in metrics
    }
    task_values = sorted({a.labels.get(TASK_KEY, "") for a in adapters})
    groups = torch.tensor(
        [task_values.index(a.labels[TASK_KEY]) if TASK_KEY in a.labels else len(task_values) + i for i, a in enumerate(adapters)]
    )
    perm = torch.randperm(n, generator=gen)
    n_val = max(1, int(round(options.val_fraction * n))) if n >= 10 else 0
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    opt = torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=options.weight_decay)

    def loss_on(rows: torch.Tensor, train: bool) -> torch.Tensor:
        batch = select(tokens, rows)
        total = torch.zeros((), device=device)
        if options.objective in ("supervised", "both"):
            view = _augment(batch, gen, options, contrastive_view=options.augment_truncation) if train else batch
            z = model(to_device(view, device))
            logits, reg = model.predict(z)
            for k, lg in logits.items():
                y = targets[k][rows].to(device)
                if (y != -100).any():
                    total = total + nn.functional.cross_entropy(lg, y, ignore_index=-100)
            for k, out in reg.items():
                y = reg_targets[k][rows].to(device)
                ok = ~torch.isnan(y)
                if ok.any():
                    total = total + nn.functional.mse_loss(out[ok], y[ok])
        if options.objective in ("contrastive", "both"):
            z1 = model(to_device(_augment(batch, gen, options, contrastive_view=True), device))
            z2 = model(to_device(_augment(batch, gen, options, contrastive_view=True), device))
            total = total + _supcon(z1, z2, groups[rows].to(device), options.temperature)
        return total

    best, best_state, stale = math.inf, copy.deepcopy(model.state_dict()), 0
    history: list[dict[str, float]] = []
    bar = tqdm(range(options.epochs), desc=f"train w2t ({options.objective})", unit="epoch", disable=not progress)
    for epoch in bar:
        model.train()
        order = train_idx[torch.randperm(len(train_idx), generator=gen)]
        train_loss = 0.0
        for start in range(0, len(order), options.batch_size):
            rows = order[start : start + options.batch_size]
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
            val_loss = float(loss_on(val_idx, train=False)) if n_val >= 2 else train_loss / max(1, len(order))
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
    embedder = Embedder(model, schema, rank, stats, options.objective, history, metric_range=ranges)
    if metrics and n_val >= 2:
        val = [adapters[i] for i in val_idx.tolist()]
        _, predicted = embedder.predict(val)
        for m in metrics:
            pairs = [(p, a.measurements[m]) for p, a in zip(predicted[m], val, strict=True) if m in a.measurements]
            if len(pairs) >= 2:
                embedder.residual_std[m] = float(np.std([p - t for p, t in pairs]))
    if n_val >= 2:
        embedder.hybrid_weight = choose_hybrid_weight(embedder, adapters, val_idx.tolist())
    return embedder


HYBRID_WEIGHTS = tuple(i / 10 for i in range(11))


def choose_hybrid_weight(embedder: Embedder, adapters: list[ZooAdapter], val_rows: list[int]) -> float:
    """The hybrid weight that retrieves best (MRR + nDCG@10, relevance = same task) with the validation
    adapters as queries against all the training adapters; 0.5 when the validation adapters have no tasks."""
    queries = [r for r in val_rows if TASK_KEY in adapters[r].labels]
    if len(queries) < 2:
        return 0.5
    module = module_cosine_matrix([adapters[r].factors for r in queries], [a.factors for a in adapters])
    z = embedder.embed(adapters)
    w2t = z[queries] @ z.T
    tasks = [a.labels.get(TASK_KEY, "") for a in adapters]

    def quality(weight: float) -> float:
        r = retrieval(hybrid_score(module, w2t, weight), [tasks[q] for q in queries], tasks, list(queries))
        return r["mrr"] + r["ndcg@10"]

    return max(HYBRID_WEIGHTS, key=quality)
