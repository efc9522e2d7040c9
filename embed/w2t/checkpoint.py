"""A W2T checkpoint directory: its files, and its metadata read without loading the models (no torch), the methods
chosen in it stored by name (zoo.domain.methods), with the channel metrics and the centred input Gram's reference they
may weigh."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from embed.selection.metrics import KNN_K
from zoo.domain.centred_gram import GramReference
from zoo.domain.channel_metric import ChannelMetric
from zoo.domain.methods import KnnPredictor, LearnedPredictor, Predictor, SearchScore

META = "embedder.json"
WEIGHTS = "model.safetensors"
MEMORY = "memory.safetensors"
#: the centred input Gram's reference, fitted on the labelled adapters (zoo/domain/centred_gram.py); absent from
#: checkpoints from before it, or whose exact scores were estimated from sketches
GRAM_REFERENCE = "gram_reference.safetensors"


@functools.lru_cache(maxsize=16)
def checkpoint_meta(directory: Path) -> dict:
    """The checkpoint's metadata (config, schema, hybrid weight, predictors...); directories are never rewritten."""
    return json.loads((Path(directory) / META).read_text())


def search_of(meta: dict) -> SearchScore:
    """The search score a checkpoint serves, by name; before second stages it was kept as its exact score and W2T
    weight, and before the choice among exact scores, module cosine was the exact one."""
    if "search" in meta:
        return SearchScore.parse(meta["search"])
    return SearchScore(meta.get("exact_score", "module"), float(meta["hybrid_weight"]))


def predictors_of(meta: dict) -> dict[str, Predictor]:
    """Each target's predictor in a checkpoint: a kNN ("knn") by its similarity, k, temperature, size width and trend
    (none before kNNs had them) under "knn", a learned one by
    its kind; before kNN predictors were chosen, "search" meant a KNN_K-NN over the search score."""
    knn = meta.get("knn", {})
    predictors: dict[str, Predictor] = {}
    for target, kind in meta["predictor"].items():
        if kind == "search":
            predictors[target] = KnnPredictor(search_of(meta).first_stage, KNN_K)
        elif kind == KnnPredictor.kind:
            t, h = knn[target].get("temperature"), knn[target].get("width")
            predictors[target] = KnnPredictor(
                SearchScore.parse(knn[target]["similarity"]),
                int(knn[target]["k"]),
                None if t is None else float(t),
                None if h is None else float(h),
                bool(knn[target].get("trend", False)),
            )
        else:
            predictors[target] = LearnedPredictor.parse(kind)
    return predictors


def channel_metrics_of(meta: dict) -> dict[str, ChannelMetric]:
    """The channel metrics fitted on the labelled adapters (embed/selection/fitted.py), by their score's name; none before
    they were candidates."""
    return {name: ChannelMetric.from_dict(d) for name, d in meta.get("channel_metrics", {}).items()}


@functools.lru_cache(maxsize=16)
def gram_reference_of(directory: Path) -> GramReference | None:
    """The checkpoint's centred input Gram reference, None where it has none (no torch: the file read as numpy)."""
    path = Path(directory) / GRAM_REFERENCE
    return GramReference.from_arrays(load_file(str(path))) if path.exists() else None


def save_gram_reference(directory: Path, reference: GramReference | None) -> None:
    """Write a reference that gram_reference_of reads back (nothing for None)."""
    if reference is not None:
        save_file({k: np.ascontiguousarray(v) for k, v in reference.arrays().items()}, str(Path(directory) / GRAM_REFERENCE))


def methods_meta(search: SearchScore, predictors: dict[str, Predictor], metrics: dict[str, ChannelMetric]) -> dict[str, object]:
    """The metadata search_of, predictors_of and channel_metrics_of read back."""
    return {
        "channel_metrics": {name: m.as_dict() for name, m in metrics.items()},
        "search": search.name,
        "exact_score": search.exact,
        "hybrid_weight": search.w2t_weight,
        "predictor": {target: p.kind for target, p in predictors.items()},
        "knn": {t: _knn_meta(p) for t, p in predictors.items() if isinstance(p, KnnPredictor)},
    }


def _knn_meta(knn: KnnPredictor) -> dict[str, object]:
    """A kNN predictor as predictors_of reads it back: its temperature, size width and trend only where it has them, so that
    checkpoints of kNNs without them are written as they always were."""
    optional = {"temperature": knn.temperature, "width": knn.width, "trend": knn.trend or None}
    return {"similarity": knn.similarity.name, "k": knn.k, **{k: v for k, v in optional.items() if v is not None}}
