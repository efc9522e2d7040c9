"""The runtime model: a trained W2T ensemble with everything needed to embed and predict new adapters (its
checkpoint's reading and writing included). Serving (embed.serving.engine) imports it from here; training
(embed.training.train) builds it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from embed.data.tokens import Batch, n_rows, select, to_device, token_shapes, tokenize
from embed.data.types import SpaceSchema, ZooAdapter
from embed.selection.calibration import NEVER_SURE, Calibration
from embed.selection.choice import prototype_shares, softmax_rows
from embed.selection.metrics import knn_regress
from embed.w2t.checkpoint import (
    MEMORY,
    META,
    WEIGHTS,
    channel_metrics_of,
    checkpoint_meta,
    gram_reference_of,
    methods_meta,
    predictors_of,
    save_gram_reference,
    search_of,
)
from embed.w2t.model import W2T, W2TConfig
from zoo.domain.centred_gram import GramReference
from zoo.domain.channel_metric import ChannelMetric
from zoo.domain.methods import HEAD, LOGREG, NEIGHBOURS, PROTOTYPE, Predictor, SearchScore

#: adapters per forward pass when embedding (at most: see TOKENS_PER_BATCH)
EMBED_BATCH = 256
#: rank tokens (adapters × modules × padded rank) per forward pass, embedding or training: a batch's memory is bounded
#: whatever the adapters' size (Llama-3-8B r16: 3,584 a adapter, 73 a batch; SDXL r8: 8,280, 31 a batch)
TOKENS_PER_BATCH = 1 << 18


def batch_rows(per_adapter: int, cap: int) -> int:
    """Adapters per forward pass: at most `cap`, and at most TOKENS_PER_BATCH rank tokens (at least one adapter)."""
    return max(1, min(cap, TOKENS_PER_BATCH // max(per_adapter, 1)))


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
    #: the search score, chosen out of fold (embed/selection/search_choice.py): an exact score ("dw": the whole update's cosine,
    #: "module": the mean module cosine) mixed with this embedding's cosine
    search: SearchScore = SearchScore()
    #: per attribute: the heads, a readout of this embedding (prototype, logreg) or a similarity-weighted kNN among
    #: the labelled training adapters; per metric: the heads, the kNN over this embedding (neighbours) or a kNN
    #: among the labelled training adapters; chosen out of fold
    predictors: dict[str, Predictor] = field(default_factory=dict)
    #: the labelled training adapters: ids, embeddings, measured values per metric (NaN where unknown) and
    #: labels per attribute ("" where unknown)
    memory: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.float32))
    memory_values: dict[str, np.ndarray] = field(default_factory=dict)
    memory_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    memory_labels: dict[str, list[str]] = field(default_factory=dict)
    #: each choice with its out-of-fold scores and reason (embed.selection.choice.Choice.as_dict), by "search" and target
    choices: dict[str, dict[str, object]] = field(default_factory=dict)
    #: per attribute predicted by logreg: the logistic regression on the embedding (classes, coef, intercept)
    readouts: dict[str, dict[str, list]] = field(default_factory=dict)
    #: per attribute: the chosen predictor's calibration, fit on its out-of-fold shares (embed/selection/calibration.py);
    #: checkpoints from before calibration have none and serve raw shares
    calibration: dict[str, Calibration] = field(default_factory=dict)
    #: the channel metrics fitted on the labelled training adapters, by their score's name (zoo.domain.methods.fitted_score):
    #: what a search score or kNN that weighs one serves (embed/selection/fitted.py)
    channel_metrics: dict[str, ChannelMetric] = field(default_factory=dict)
    #: the centred input Gram's reference, fitted on a sample of the training adapters, labelled or not
    #: (zoo/domain/centred_gram.py reference_sample): what a search score or kNN that weighs it serves
    gram_reference: GramReference | None = None
    #: the labelled training adapters' update profiles (zoo.domain.sizes.update_profile: a row each, in memory order;
    #: a checkpoint from before profiles holds their sizes alone, one column): what a kNN that weighs its neighbours by
    #: size (KnnPredictor.width) or follows the trend (KnnPredictor.trend) reads; empty where the choices were not made
    #: or from a checkpoint older than such kNNs
    memory_profiles: np.ndarray = field(default_factory=lambda: np.zeros((0, 1)))
    #: per metric whose kNN follows the trend of value with the update's profile (KnnPredictor.trend): the slope over
    #: the profile's first columns, fitted on the labelled training adapters (embed.selection.metrics.trend_slope)
    trend_slopes: dict[str, np.ndarray] = field(default_factory=dict)
    _memory_classes: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def memory_classes(self, attribute: str) -> np.ndarray:
        """The memory's class index (in the heads' class order, -1 unknown) per labelled adapter, computed once."""
        if attribute not in self._memory_classes:
            at = {c: i for i, c in enumerate(self.config.categorical[attribute])}
            self._memory_classes[attribute] = np.array([at.get(v, -1) for v in self.memory_labels[attribute]], np.int64)
        return self._memory_classes[attribute]

    def calibrated(self, attribute: str, shares: np.ndarray, own_label_left_out: bool = False) -> np.ndarray:
        """The chosen predictor's raw class shares of an attribute as calibrated probabilities; `own_label_left_out`:
        the shares are a vote on one of the labelled adapters by the others (Calibration.for_labelled)."""
        c = self.calibration.get(attribute)
        if c is None:
            return shares
        return (c.for_labelled() if own_label_left_out else c).apply(shares)

    def sure_from(self, attribute: str) -> float:
        """The least calibrated probability of an attribute's prediction called sure (Calibration.sure_from); an
        uncalibrated predictor earned none."""
        c = self.calibration.get(attribute)
        return c.sure_from if c is not None else NEVER_SURE

    def predictor(self, target: str) -> Predictor:
        """A target's predictor: the heads where none was chosen."""
        return self.predictors.get(target, HEAD)

    @property
    def config(self) -> W2TConfig:
        return self.models[0].config

    @property
    def dim(self) -> int:
        """Dimension of the embedding: the members' embeddings side by side."""
        return len(self.models) * self.config.embed_dim

    @property
    def batch_rows(self) -> int:
        """Adapters per forward pass: the rank tokens of a batch are bounded, so its memory does not depend on the zoo."""
        return batch_rows(len(self.schema.modules) * self.rank, EMBED_BATCH)

    def _batches(self, adapters: list[ZooAdapter]) -> Iterator[Batch]:
        size = self.batch_rows
        for start in range(0, len(adapters), size):
            yield tokenize(adapters[start : start + size], self.schema, self.rank, self.config.tokens)

    def _token_batches(self, tokens: Batch, rows: list[int] | None = None) -> Iterator[Batch]:
        """Bounded batches of the given rows (all by default) of tokens made with this ensemble's spec."""
        order = torch.arange(n_rows(tokens)) if rows is None else torch.tensor(rows, dtype=torch.long)
        size = self.batch_rows
        for start in range(0, len(order), size):
            yield select(tokens, order[start : start + size])

    def _forward(self, adapters: list[ZooAdapter]) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(unit embeddings, class probabilities per attribute, head outputs per metric in their own units)."""
        return self._forward_batches(self._batches(adapters))

    @torch.no_grad()
    def _forward_batches(self, batches: Iterable[Batch]) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
        device = next(self.models[0].parameters()).device
        for model in self.models:
            model.eval()
        zs: list[torch.Tensor] = []
        probs: dict[str, list[torch.Tensor]] = {k: [] for k in self.config.categorical}
        heads: dict[str, list[torch.Tensor]] = {k: [] for k in self.config.regression}
        for b in batches:
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
        """Unit vectors (len(adapters), dim): cosine = the members' mean cosine. The adapters' factors may be at full
        width or projected with this ensemble's spec (embed.data.tokens.project)."""
        return self._forward(adapters)[0]

    def neighbour_values(self, z: np.ndarray, metric: str) -> np.ndarray:
        """Similarity-weighted mean of the metric over the most similar adapters of the memory."""
        values = self.memory_values[metric]
        known = ~np.isnan(values)
        return knn_regress(z @ self.memory[known].T, values[known])

    def predict(self, adapters: list[ZooAdapter]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(class probabilities per attribute, predicted metric values in their own units) from the heads, or
        for a metric whose predictor is "neighbours" from the kNN in the embedding. Targets whose predictor is
        "knn" need the exact scores to the memory: the caller predicts those (embed.serving.engine, embed.training.evaluate)."""
        z, probs, values = self._forward(adapters)
        for k in probs:
            if self.predictor(k) in (PROTOTYPE, LOGREG) and len(adapters):
                probs[k] = self._readout(k, z)
        for k in values:
            if self.predictor(k) == NEIGHBOURS and len(adapters):
                values[k] = self.neighbour_values(z, k)
            values[k] = self.clip(k, values[k])
        return probs, values

    def _readout(self, attribute: str, z: np.ndarray) -> np.ndarray:
        """Class probabilities (in the heads' class order) of a few-shot readout of the embedding: the nearest
        class mean of the memory (softmax of cosines at temperature 0.1), or the logistic regression."""
        classes = self.config.categorical[attribute]
        if self.predictor(attribute) == PROTOTYPE:
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
        memory["profiles"] = torch.from_numpy(np.ascontiguousarray(self.memory_profiles, dtype=np.float64))
        save_file(memory, str(directory / MEMORY))
        meta = {
            "config": self.config.as_dict(),
            # what the config's token_width and projection_seed make of each module type (for reading; not read back)
            "token_shapes": {t: list(s) for t, s in token_shapes(self.schema, self.config.tokens).items()},
            "members": len(self.models),
            "schema": self.schema.as_dict(),
            "rank": self.rank,
            "metric_stats": self.metric_stats,
            "objective": self.objective,
            "history": self.history,
            "residual_std": self.residual_std,
            "trend_slopes": {k: np.atleast_1d(v).tolist() for k, v in self.trend_slopes.items()},
            "metric_range": self.metric_range,
            **methods_meta(self.search, self.predictors, self.channel_metrics),
            "memory_labels": self.memory_labels,
            "choices": self.choices,
            "readouts": self.readouts,
            "calibration": {k: c.as_dict() for k, c in self.calibration.items()},
        }
        save_gram_reference(directory, self.gram_reference)
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
        return cls(
            models,
            SpaceSchema.from_dict(meta["schema"]),
            int(meta["rank"]),
            {k: (float(v[0]), float(v[1])) for k, v in meta["metric_stats"].items()},
            meta["objective"],
            meta["history"],
            meta["residual_std"],
            {k: (float(v[0]), float(v[1])) for k, v in meta["metric_range"].items()},
            search_of(meta),
            predictors_of(meta),
            memory["embedding"].numpy(),
            {k.removeprefix("values."): v.numpy() for k, v in memory.items() if k.startswith("values.")},
            memory["ids"].numpy() if "ids" in memory else np.zeros(0, dtype=np.int64),
            meta.get("memory_labels", {}),
            meta.get("choices", {}),
            meta.get("readouts", {}),
            calibration={k: Calibration.from_dict(c) for k, c in meta.get("calibration", {}).items()},
            channel_metrics=channel_metrics_of(meta),
            gram_reference=gram_reference_of(directory),
            memory_profiles=_profiles_of(memory),
            trend_slopes={k: np.atleast_1d(np.asarray(v, np.float64)) for k, v in meta.get("trend_slopes", {}).items()},
        )


def _profiles_of(memory: dict[str, torch.Tensor]) -> np.ndarray:
    """The memory's update profiles, a row each: a checkpoint from before profiles kept the sizes alone (its trends'
    slopes are over that one column); one from before sizes, none."""
    if "profiles" in memory:
        return memory["profiles"].numpy()
    return memory["sizes"].numpy()[:, None] if "sizes" in memory else np.zeros((0, 1))
