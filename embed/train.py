"""Training the W2T embedder: supervised multi-task heads, contrastive, or both.

Supervised: cross-entropy per categorical attribute known for the adapters, MSE on each
standardized measured metric. Contrastive: two views of every adapter (its weakest rank
components truncated, small noise on u and v); positives are the other view and, where the zoo
has them, adapters of the same task (supervised-contrastive loss). Early stopping on a
validation split; deterministic from the seed on the CPU.

An embedder is a small ensemble: `members` models trained from consecutive seeds, each
early-stopped on its own slice of the adapters, so the ensemble learns from all of them and every
held-out slice has a member that never trained on it. Its embedding concatenates theirs (its
cosine is their mean cosine) and its class probabilities average theirs: one W2T model varies a
lot from seed to seed on a few hundred adapters. Each metric is predicted either by the
regression heads or, where they rank the held-out adapters clearly better (Spearman, out of fold,
paired bootstrap), by the measured values of the most similar training adapters in the embedding;
the hybrid search weight is chosen out of fold too.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

from embed.calibration import Calibration
from embed.checkpoint import MEMORY, META, WEIGHTS, checkpoint_meta
from embed.choice import (
    Fold,
    choose_attribute,
    choose_metric,
    choose_search,
    knn_name,
    logistic_readout,
    parse_knn,
    parse_search,
    prototype_shares,
    readout_predictions,
    search_name,
    softmax_rows,
)
from embed.metrics import KNN_K, knn_regress
from embed.model import W2T, W2TConfig
from embed.similarity import EXACT_SCORES, ModuleStack, dense_modules, exact_cosines
from embed.tokens import Batch, TypeTokens, max_rank, select, to_device, tokenize
from embed.types import SpaceSchema, ZooAdapter
from zoo.labels import TASK_KEY

#: adapters per forward pass when embedding
EMBED_BATCH = 256


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
    #: models in the ensemble, trained from seeds seed, seed + 1, ...
    members: int = 5


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


PREDICTORS = ("head", "neighbours")


@dataclass
class W2TEnsemble:
    """A trained W2T ensemble with everything needed to embed and predict new adapters."""

    models: list[W2T]
    schema: SpaceSchema
    rank: int
    metric_stats: dict[str, tuple[float, float]]
    objective: str
    #: per member and epoch: {"member", "epoch", "train_loss", "val_loss"}
    history: list[dict[str, float]] = field(default_factory=list)
    #: per metric: std of (predicted - measured) on the held-out slices, for prediction intervals
    residual_std: dict[str, float] = field(default_factory=dict)
    #: per metric: (min, max) over the training adapters; predictions and intervals stay inside it
    metric_range: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: the search score, chosen out of fold (embed/choice.py): an exact score ("dw": the whole update's cosine,
    #: "module": the mean module cosine) mixed with this embedding's cosine at `hybrid_weight` (0: exact alone)
    exact_score: str = "dw"
    hybrid_weight: float = 0.0
    #: per attribute: "head", "prototype", "logreg" (readouts of this embedding) or "knn" (a similarity-weighted
    #: kNN among the labelled training adapters, by the similarity and k in `knn`); per metric: "head",
    #: "neighbours" (kNN over this embedding) or "knn"; chosen out of fold
    predictor: dict[str, str] = field(default_factory=dict)
    #: the labelled training adapters: ids, embeddings, measured values per metric (NaN where unknown) and
    #: labels per attribute ("" where unknown)
    memory: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.float32))
    memory_values: dict[str, np.ndarray] = field(default_factory=dict)
    memory_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    memory_labels: dict[str, list[str]] = field(default_factory=dict)
    #: each choice with its out-of-fold scores and reason (embed.choice.Choice.as_dict), by "search" and target
    choices: dict[str, dict[str, object]] = field(default_factory=dict)
    #: per attribute predicted by "logreg": the logistic regression on the embedding (classes, coef, intercept)
    readouts: dict[str, dict[str, list]] = field(default_factory=dict)
    #: per target predicted by "knn": {"similarity": a search score's name (embed.choice.search_name), "k": neighbours}
    knn: dict[str, dict[str, object]] = field(default_factory=dict)
    #: per attribute: the chosen predictor's calibration, fit on its out-of-fold shares (embed/calibration.py);
    #: checkpoints from before calibration have none and serve raw shares
    calibration: dict[str, Calibration] = field(default_factory=dict)
    _memory_classes: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def memory_classes(self, attribute: str) -> np.ndarray:
        """The memory's class index (in the heads' class order, -1 unknown) per labelled adapter, computed once."""
        if attribute not in self._memory_classes:
            at = {c: i for i, c in enumerate(self.config.categorical[attribute])}
            self._memory_classes[attribute] = np.array([at.get(v, -1) for v in self.memory_labels[attribute]], np.int64)
        return self._memory_classes[attribute]

    def calibrated(self, attribute: str, shares: np.ndarray) -> np.ndarray:
        """The chosen predictor's raw class shares of an attribute as calibrated probabilities."""
        c = self.calibration.get(attribute)
        return c.apply(shares) if c is not None else shares

    def choose(self, target: str, chosen: str) -> None:
        """Record a target's predictor from its chosen candidate's name (embed.choice: `head`, `knn dw k=3`, ...)."""
        if chosen.startswith("knn "):
            similarity, k = parse_knn(chosen)
            self.predictor[target], self.knn[target] = "knn", {"similarity": similarity, "k": k}
        else:
            self.predictor[target] = chosen
            self.knn.pop(target, None)

    def predictor_name(self, target: str) -> str:
        """A target's predictor as a candidate's name: `head`, `logreg`, `knn dw k=3`."""
        if self.predictor.get(target) == "knn":
            return knn_name(str(self.knn[target]["similarity"]), int(self.knn[target]["k"]))  # type: ignore[call-overload]
        return self.predictor.get(target, "head")

    @property
    def search(self) -> str:
        """The chosen search score's name (embed.choice.search_name)."""
        return search_name(self.exact_score, self.hybrid_weight)

    @property
    def config(self) -> W2TConfig:
        return self.models[0].config

    @property
    def dim(self) -> int:
        """Dimension of the embedding: the members' embeddings side by side."""
        return len(self.models) * self.config.embed_dim

    def _batches(self, adapters: list[ZooAdapter], size: int = EMBED_BATCH):  # type: ignore[no-untyped-def]
        for start in range(0, len(adapters), size):
            yield tokenize(adapters[start : start + size], self.schema, self.rank)

    @torch.no_grad()
    def _forward(self, adapters: list[ZooAdapter]) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(unit embeddings, class probabilities per attribute, head outputs per metric in their own units)."""
        device = next(self.models[0].parameters()).device
        for model in self.models:
            model.eval()
        zs, probs, heads = [], {k: [] for k in self.config.categorical}, {k: [] for k in self.config.regression}  # type: ignore[var-annotated]
        for b in self._batches(adapters):
            b = to_device(b, device)
            parts, member_probs, member_values = [], [], []
            for model in self.models:
                z = model(b)
                parts.append(nn.functional.normalize(z, dim=-1))
                logits, reg = model.predict(z)
                member_probs.append({k: torch.softmax(v, dim=-1) for k, v in logits.items()})
                member_values.append(reg)
            zs.append((torch.cat(parts, dim=-1) / math.sqrt(len(self.models))).cpu())
            for k in probs:
                probs[k].append(torch.stack([p[k] for p in member_probs]).mean(0).cpu())
            for k in heads:
                mean, std = self.metric_stats[k]
                heads[k].append(torch.stack([v[k] for v in member_values]).mean(0).cpu() * std + mean)
        z = torch.cat(zs).numpy() if zs else np.zeros((0, self.dim), dtype=np.float32)
        return z, {k: torch.cat(v).numpy() for k, v in probs.items()}, {k: torch.cat(v).numpy() for k, v in heads.items()}

    def embed(self, adapters: list[ZooAdapter]) -> np.ndarray:
        """Unit vectors (len(adapters), dim): cosine = the members' mean cosine."""
        return self._forward(adapters)[0]

    def neighbour_values(self, z: np.ndarray, metric: str) -> np.ndarray:
        """Similarity-weighted mean of the metric over the most similar adapters of the memory."""
        values = self.memory_values[metric]
        known = ~np.isnan(values)
        return knn_regress(z @ self.memory[known].T, values[known])

    def predict(self, adapters: list[ZooAdapter]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(class probabilities per attribute, predicted metric values in their own units) from the heads, or
        for a metric whose predictor is "neighbours" from the kNN in the embedding. Targets whose predictor is
        "knn" need the exact scores to the memory: the caller predicts those (embed.engine, embed.evaluate)."""
        z, probs, values = self._forward(adapters)
        for k in probs:
            if self.predictor.get(k) in ("prototype", "logreg") and len(adapters):
                probs[k] = self._readout(k, z)
        for k in values:
            if self.predictor.get(k) == "neighbours" and len(adapters):
                values[k] = self.neighbour_values(z, k)
            values[k] = self.clip(k, values[k])
        return probs, values

    def _readout(self, attribute: str, z: np.ndarray) -> np.ndarray:
        """Class probabilities (in the heads' class order) of a few-shot readout of the embedding: the nearest
        class mean of the memory (softmax of cosines at temperature 0.1), or the logistic regression."""
        classes = self.config.categorical[attribute]
        if self.predictor[attribute] == "prototype":
            labels = self.memory_labels[attribute]
            memory = np.vstack([self.memory, z])
            train = [r for r, label in enumerate(labels) if label]
            return prototype_shares(memory, labels + [""] * len(z), classes, train, list(range(len(labels), len(memory))))
        r = self.readouts[attribute]
        scores = z @ np.array(r["coef"]).T + np.array(r["intercept"])
        logits = np.full((len(z), len(classes)), -np.inf)
        known = [classes.index(c) for c in r["classes"]]
        if len(r["classes"]) == 2:  # binary: one column, the second class's log-odds
            logits[:, known[0]], logits[:, known[1]] = 0.0, scores[:, 0]
        else:
            logits[:, known] = scores
        return softmax_rows(logits)

    def clip(self, metric: str, values: np.ndarray) -> np.ndarray:
        low, high = self.metric_range.get(metric, (-math.inf, math.inf))
        return np.clip(values, low, high)

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        state = {f"{i}.{k}": v.detach().cpu().contiguous() for i, m in enumerate(self.models) for k, v in m.state_dict().items()}
        save_file(state, str(directory / WEIGHTS))
        memory = {
            "embedding": torch.from_numpy(np.ascontiguousarray(self.memory, dtype=np.float32)),
            "ids": torch.from_numpy(np.ascontiguousarray(self.memory_ids, dtype=np.int64)),
        }
        memory.update({f"values.{k}": torch.from_numpy(np.ascontiguousarray(v, dtype=np.float64)) for k, v in self.memory_values.items()})
        save_file(memory, str(directory / MEMORY))
        meta = {
            "config": self.config.as_dict(),
            "members": len(self.models),
            "schema": self.schema.as_dict(),
            "rank": self.rank,
            "metric_stats": self.metric_stats,
            "objective": self.objective,
            "history": self.history,
            "residual_std": self.residual_std,
            "metric_range": self.metric_range,
            "exact_score": self.exact_score,
            "hybrid_weight": self.hybrid_weight,
            "predictor": self.predictor,
            "memory_labels": self.memory_labels,
            "choices": self.choices,
            "readouts": self.readouts,
            "knn": self.knn,
            "calibration": {k: c.as_dict() for k, c in self.calibration.items()},
        }
        (directory / META).write_text(json.dumps(meta, indent=1))

    @classmethod
    def load(cls, directory: Path, device: str | None = None) -> W2TEnsemble:
        meta = checkpoint_meta(directory)
        config = W2TConfig.from_dict(meta["config"])
        state = load_file(str(directory / WEIGHTS))
        models = []
        for i in range(int(meta["members"])):
            model = W2T(config)
            model.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items() if k.startswith(f"{i}.")})
            models.append(model.to(torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))))
        memory = load_file(str(directory / MEMORY))
        knn = _knn_of(meta)  # before the predictors are read: it renames an old checkpoint's "search"
        return cls(
            models,
            SpaceSchema.from_dict(meta["schema"]),
            int(meta["rank"]),
            {k: (float(v[0]), float(v[1])) for k, v in meta["metric_stats"].items()},
            meta["objective"],
            meta["history"],
            meta["residual_std"],
            {k: (float(v[0]), float(v[1])) for k, v in meta["metric_range"].items()},
            meta.get("exact_score", "module"),  # checkpoints from before the choice mixed with module cosine
            meta["hybrid_weight"],
            meta["predictor"],
            memory["embedding"].numpy(),
            {k.removeprefix("values."): v.numpy() for k, v in memory.items() if k.startswith("values.")},
            memory["ids"].numpy() if "ids" in memory else np.zeros(0, dtype=np.int64),
            meta.get("memory_labels", {}),
            meta.get("choices", {}),
            meta.get("readouts", {}),
            knn=knn,
            calibration={k: Calibration.from_dict(c) for k, c in meta.get("calibration", {}).items()},
        )


def _knn_of(meta: dict) -> dict[str, dict[str, object]]:
    """The kNN predictors of a checkpoint; before they were chosen, "search" meant a 10-NN over the search score."""
    knn = dict(meta.get("knn", {}))
    for target, predictor in meta["predictor"].items():
        if predictor == "search":
            meta["predictor"][target] = "knn"
            knn[target] = {"similarity": search_name(meta.get("exact_score", "module"), meta["hybrid_weight"]), "k": KNN_K}
    return knn


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
    """Each member validates on its own slice of one seeded permutation (disjoint while they fit), so the
    ensemble as a whole learns from every adapter and each adapter has a member that never trained on it."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(options.seed))
    n_val = max(1, int(round(options.val_fraction * n))) if n >= 10 else 0
    out = []
    for i in range(members):
        val = (torch.arange(n_val) + i * n_val) % n
        rest = torch.ones(n, dtype=torch.bool)
        rest[val] = False
        out.append(_Fold(train=perm[rest], val=perm[val]))
    return out


def _train_member(
    config: W2TConfig, data: _Data, fold: _Fold, options: TrainOptions, seed: int, device: torch.device, desc: str, progress: bool
) -> tuple[W2T, list[dict[str, float]]]:
    """One model, early-stopped on its fold's validation loss: (model, history)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = W2T(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=options.weight_decay)

    has_target = data.has_target

    def loss_on(rows: torch.Tensor, train: bool) -> torch.Tensor:
        total = torch.zeros((), device=device)
        if options.objective == "supervised":  # only rows with a target count: the others are not forwarded at all
            rows = rows[has_target[rows]]
            if not len(rows):
                return total
        batch = select(data.tokens, rows)
        if options.objective in ("supervised", "both"):
            view = _augment(batch, gen, options, contrastive_view=options.augment_truncation) if train else batch
            z = model(to_device(view, device))
            logits, reg = model.predict(z)
            for k, lg in logits.items():
                y = data.targets[k][rows].to(device)
                if (y != -100).any():
                    total = total + nn.functional.cross_entropy(lg, y, ignore_index=-100)
            for k, out in reg.items():
                y = data.reg_targets[k][rows].to(device)
                ok = ~torch.isnan(y)
                if ok.any():
                    total = total + nn.functional.mse_loss(out[ok], y[ok])
        if options.objective in ("contrastive", "both"):
            z1 = model(to_device(_augment(batch, gen, options, contrastive_view=True), device))
            z2 = model(to_device(_augment(batch, gen, options, contrastive_view=True), device))
            total = total + _supcon(z1, z2, data.groups[rows].to(device), options.temperature)
        return total

    n_val = len(fold.val)
    best, best_state, stale = math.inf, copy.deepcopy(model.state_dict()), 0
    history: list[dict[str, float]] = []
    bar = tqdm(range(options.epochs), desc=desc, unit="epoch", disable=not progress)
    for epoch in bar:
        model.train()
        order = fold.train[torch.randperm(len(fold.train), generator=gen)]
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
            val_loss = float(loss_on(fold.val, train=False)) if n_val >= 2 else train_loss / max(1, len(order))
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


def train_w2t(adapters: list[ZooAdapter], schema: SpaceSchema, options: TrainOptions, progress: bool = True) -> W2TEnsemble:
    """Train on `adapters`: each member early-stops on its own held-out slice, which also scores the choices."""
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
    n = len(adapters)
    task_values = sorted({a.labels.get(TASK_KEY, "") for a in adapters})
    data = _Data(
        tokens=tokenize(adapters, schema, rank),
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
        model, member_history = _train_member(config, data, fold, options, options.seed + i, device, desc, progress)
        models.append(model)
        history += [{"member": i, **h} for h in member_history]
    embedder = W2TEnsemble(models, schema, rank, stats, options.objective, history, metric_range=ranges)
    remember_and_choose(embedder, adapters, options)
    return embedder


def remember_and_choose(embedder: W2TEnsemble, adapters: list[ZooAdapter], options: TrainOptions) -> None:
    """A trained ensemble's memory (its labelled training adapters) and its out-of-fold choices, from the adapters
    it trained on (in the same order) and the options it trained with (which fix each member's fold)."""
    models, config, e = embedder.models, embedder.config, embedder
    singles = [W2TEnsemble([m], e.schema, e.rank, e.metric_stats, e.objective, metric_range=e.metric_range) for m in models]
    member_z = [single.embed(adapters) for single in singles]
    z = np.concatenate(member_z, axis=1) / math.sqrt(len(models))  # what embedder.embed gives, without a second pass
    categorical, metrics = config.categorical, config.regression
    known = [r for r, a in enumerate(adapters) if any(k in a.labels for k in categorical) or any(m in a.measurements for m in metrics)]
    embedder.memory, embedder.memory_ids = z[known], np.array([adapters[r].id for r in known], dtype=np.int64)
    embedder.memory_values = {m: np.array([adapters[r].measurements.get(m, np.nan) for r in known]) for m in metrics}
    embedder.memory_labels = {k: [adapters[r].labels.get(k, "") for r in known] for k in categorical}
    embedder.predictor, embedder.knn, embedder.choices, embedder.readouts, embedder.residual_std = {}, {}, {}, {}, {}
    embedder.calibration, embedder._memory_classes = {}, {}
    folds = _folds(len(adapters), len(models), options)
    if len(folds[0].val) >= 2 and embedder.objective != "contrastive":  # choices made out of fold
        _choose(embedder, [adapters[r] for r in known], known, singles, member_z, folds)


def _choose(
    embedder: W2TEnsemble,
    labelled: list[ZooAdapter],
    rows: list[int],
    singles: list[W2TEnsemble],
    member_z: list[np.ndarray],
    folds: list[_Fold],
) -> None:
    """The search score and each target's predictor, out of fold (embed/choice.py), over the labelled adapters
    (`labelled`, at `rows` of the training set); and the std of the chosen metric predictors' residuals there."""
    at = {r: i for i, r in enumerate(rows)}
    views = [
        Fold([at[r] for r in f.val.tolist() if r in at], [at[r] for r in f.train.tolist() if r in at], mz[rows])
        for f, mz in zip(folds, member_z, strict=True)
    ]
    dense = dense_modules([a.factors for a in labelled])
    stack = ModuleStack.of([a.factors for a in labelled], dense)
    exact = {score: exact_cosines(stack, stack, score) for score in EXACT_SCORES}
    search = choose_search(exact, [a.labels.get(TASK_KEY, "") for a in labelled], views, len(member_z[0]))
    embedder.exact_score, embedder.hybrid_weight = parse_search(search.chosen)
    embedder.choices = {"search": search.as_dict()}
    heads: dict[str, dict[int, object]] = {}
    for single, view in zip(singles, views, strict=True):  # each member predicts the rows it never trained on
        _, probs, values = single._forward([labelled[i] for i in view.val])
        for k, p in probs.items():
            heads.setdefault(k, {}).update(zip(view.val, p, strict=True))
        for m, v in values.items():
            heads.setdefault(m, {}).update(dict(zip(view.val, v.tolist(), strict=True)))
            single.memory = view.z[view.train]
            single.memory_values = {m: embedder.memory_values[m][view.train]}
            nbrs = single.neighbour_values(view.z[view.val], m) if not np.isnan(single.memory_values[m]).all() else v
            heads.setdefault(f"neighbours.{m}", {}).update(dict(zip(view.val, nbrs.tolist(), strict=True)))
    for k in embedder.config.categorical:
        labels, classes = embedder.memory_labels[k], embedder.config.categorical[k]
        learned = {"head": heads.get(k, {}), **readout_predictions(labels, classes, views)}
        choice, _, embedder.calibration[k] = choose_attribute(exact, search.chosen, labels, classes, learned, views, embedder.memory)  # type: ignore[arg-type]
        embedder.choose(k, choice.chosen)
        embedder.choices[k] = choice.as_dict()
        if choice.chosen == "logreg":
            model = logistic_readout(embedder.memory, labels)
            embedder.readouts[k] = {"classes": list(model.classes_), "coef": model.coef_.tolist(), "intercept": model.intercept_.tolist()}  # type: ignore[attr-defined]
    for m in embedder.config.regression:
        learned = {"head": heads.get(m, {}), "neighbours": heads.get(f"neighbours.{m}", {})}
        choice, pred, truth = choose_metric(exact, search.chosen, embedder.memory_values[m], learned, views)  # type: ignore[arg-type]
        embedder.choose(m, choice.chosen)
        embedder.choices[m] = choice.as_dict()
        if len(truth) >= 2:
            embedder.residual_std[m] = float(np.std(embedder.clip(m, pred) - truth))
