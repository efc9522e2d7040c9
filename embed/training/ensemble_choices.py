"""A trained W2T ensemble's out-of-fold choices: its search score and each target's predictor, among the training-free
exact scores, the channel metrics and W2T's own heads and neighbours (embed/selection/choice.py decides each)."""

from __future__ import annotations

import numpy as np

from embed.data.tokens import Batch
from embed.data.types import ZooAdapter
from embed.selection.choice import (
    Fold,
    choose_attribute,
    choose_metric,
    knn_similarity,
    knn_slope,
    logistic_readout,
    mean_per_row,
    readout_predictions,
)
from embed.selection.fitted import Purpose, fit_all, out_of_fold, with_fused
from embed.selection.search_choice import choose_search
from embed.w2t.ensemble import W2TEnsemble
from zoo.domain.channel_metric import Bank
from zoo.domain.methods import HEAD, LOGREG, NEIGHBOURS, KnnPredictor
from zoo.labels import TASK_KEY


def choose_methods(
    embedder: W2TEnsemble,
    labelled: list[ZooAdapter],
    rows: list[int],
    singles: list[W2TEnsemble],
    views: list[Fold],
    tokens: Batch,
    exact: dict[str, np.ndarray],
    bank: Bank | None,
    why_not: str | None,
) -> None:
    """The search score and each target's predictor, out of fold (embed/selection/choice.py), over the labelled adapters
    (`labelled`, at `rows` of the training set; `views`: each member's held-out and training positions among them,
    with its embeddings of them), among candidates that include the channel metrics (embed/selection/fitted.py) where `bank`
    holds their atoms (else `why_not` says why not); the metrics fitted on every labelled adapter; and the std of the
    chosen metric predictors' residuals there."""
    tasks = [a.labels.get(TASK_KEY, "") for a in labelled]
    if bank is not None:
        purposes = {
            "search": Purpose("search", tasks),
            **{k: Purpose("task", embedder.memory_labels[k]) for k in embedder.config.categorical},
            **{m: Purpose("performance", embedder.memory_values[m]) for m in embedder.config.regression},
        }
        exact = with_fused({**exact, **out_of_fold(bank, purposes, views)}, np.arange(len(labelled)))
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
        profiles = embedder.memory_profiles if len(embedder.memory_profiles) == len(labelled) else None
        choice, pred, truth = choose_metric(exact, similarity, embedder.memory_values[m], predicted, views, m, profiles)
        embedder.predictors[m] = choice.chosen
        if isinstance(knn := choice.chosen, KnnPredictor) and knn.trend and profiles is not None:
            known = np.flatnonzero(~np.isnan(embedder.memory_values[m])).tolist()
            embedder.trend_slopes[m] = knn_slope(exact, knn, embedder.memory, embedder.memory_values[m], profiles, known)
        embedder.choices[m] = choice.as_dict()
        if len(truth) >= 2:
            embedder.residual_std[m] = float(np.std(embedder.clip(m, pred) - truth))
