"""Retrieval, classification and regression metrics, and kNN prediction from a similarity matrix."""

from __future__ import annotations

import numpy as np

KNN_K = 10


def retrieval(sim: np.ndarray, query_labels: list[str], gallery_labels: list[str], self_index: list[int | None]) -> dict[str, float]:
    """Hit@1, Hit@10, MRR, nDCG@10 of ranking the gallery by similarity; relevance = same label.

    sim is (queries × gallery); self_index[q] is the query's own gallery column (excluded) or None.
    A query with no relevant item counts 0.
    """
    per_query = retrieval_per_query(sim, query_labels, gallery_labels, self_index)
    return {k: float(v.mean()) if len(v) else 0.0 for k, v in per_query.items()}


def retrieval_per_query(
    sim: np.ndarray, query_labels: list[str], gallery_labels: list[str], self_index: list[int | None]
) -> dict[str, np.ndarray]:
    """`retrieval`'s metrics per query (0 for a query with no relevant item). The gallery is ranked by score, ties
    in gallery order (a stable sort), without sorting it: the first relevant item's rank is counted, and only the
    items at or above each row's 10th best score are sorted."""
    scores = np.array(sim, dtype=np.float64, copy=True)
    n_queries, n = scores.shape
    out = {k: np.zeros(n_queries) for k in ("hit@1", "hit@10", "mrr", "ndcg@10")}
    if not n_queries or not n:
        return out
    codes = np.unique(np.asarray([*gallery_labels, *query_labels], dtype=object).astype(str), return_inverse=True)[1]
    relevant = codes[None, : len(gallery_labels)] == codes[len(gallery_labels) :, None]
    own = np.zeros_like(relevant)
    for q, col in enumerate(self_index):
        if col is not None:
            own[q, col] = True
    scores[own] = -np.inf
    relevant &= ~own
    n_rel = relevant.sum(axis=1)
    found = np.flatnonzero(n_rel)
    if not len(found):
        return out
    scores, relevant, own = scores[found], relevant[found], own[found]
    # the first relevant item in order: the best-scored relevant one, the first of equals; its rank counts what is above
    best_at = np.where(relevant, scores, -np.inf).argmax(axis=1)
    best = scores[np.arange(len(found)), best_at][:, None]
    before = (scores > best) | ((scores == best) & (np.arange(n)[None, :] < best_at[:, None]))
    rank = (before & ~own).sum(axis=1)
    out["hit@1"][found] = rank == 0
    out["hit@10"][found] = rank < 10
    out["mrr"][found] = 1.0 / (rank + 1)
    discounts = 1.0 / np.log2(np.arange(2, 12))
    ideal = np.cumsum(discounts)[np.minimum(n_rel[found], 10) - 1]
    ranked = n - own.sum(axis=1)  # what each row ranks: all but itself
    for i, q in enumerate(found.tolist()):
        k = min(10, int(ranked[i]))
        row = scores[i]
        tenth = np.partition(row, n - k)[n - k]
        top = np.flatnonzero((row >= tenth) & ~own[i])  # in gallery order: the stable sort below keeps ties so
        top = top[np.argsort(-row[top], kind="stable")][:k]
        out["ndcg@10"][q] = float((relevant[i, top] * discounts[: len(top)]).sum()) / ideal[i]
    return out


def top_k(row: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest values, best first: a partial sort (O(n)), then a sort of those k."""
    if len(row) > k:
        part = np.argpartition(-row, k - 1)[:k]
        return part[np.argsort(-row[part], kind="stable")]
    return np.argsort(-row, kind="stable")


def knn_weights(
    top: np.ndarray, temperature: float | None = None, gaps: np.ndarray | None = None, width: float | None = None
) -> np.ndarray:
    """The weights of a kNN's neighbours from their similarities `top`: max(s, 0) + 1e-6, or with a `temperature` T
    the softmax of s / T. A score whose values sit close together (the input Gram: about 0.06 between tasks, 0.05-0.13
    within one) weighs its neighbours nearly alike by the first; a small T lets the nearest count for more. With a
    `width` h, each weight also times exp(−Δ² / 2h²), Δ in `gaps` the neighbour's update size less the query's
    (zoo.domain.sizes.update_size)."""
    penalty = np.zeros(len(top)) if width is None or gaps is None else np.asarray(gaps, np.float64) ** 2 / (2.0 * width * width)
    if temperature is None:
        return (np.maximum(top, 0.0) + 1e-6) * np.exp(-penalty)
    from scipy.special import softmax  # imported here: every `zoo` command loads this module, few predict

    return softmax(np.asarray(top, np.float64) / temperature - penalty)


def knn_vote_shares(
    sim: np.ndarray, train_classes: np.ndarray, n_classes: int, k: int = KNN_K, temperature: float | None = None
) -> np.ndarray:
    """Per row of sim (test × train), the class shares of the similarity-weighted vote (knn_weights) of the k most
    similar training items with a known class (train_classes: class index per column, -1 unknown); a row with no
    known neighbour gets zeros."""
    sim = np.atleast_2d(sim)
    known = np.flatnonzero(np.asarray(train_classes) >= 0)
    out = np.zeros((len(sim), n_classes))
    if not len(known):
        return out
    classes = np.asarray(train_classes)[known]
    for i, row in enumerate(sim[:, known]):
        top = top_k(row, k)
        np.add.at(out[i], classes[top], knn_weights(row[top], temperature))
        out[i] /= out[i].sum()
    return out


def knn_classify(sim: np.ndarray, train_labels: list[str], k: int = KNN_K) -> list[str]:
    """Similarity-weighted vote of the k most similar training items (sim: test × train)."""
    classes = sorted(set(train_labels))
    at = {c: i for i, c in enumerate(classes)}
    index = np.array([at[label] for label in train_labels])
    return [classes[int(i)] for i in knn_vote_shares(sim, index, len(classes), k).argmax(axis=1)]


def knn_regress(
    sim: np.ndarray,
    train_values: np.ndarray,
    k: int = KNN_K,
    temperature: float | None = None,
    sizes: tuple[np.ndarray, np.ndarray] | None = None,
    width: float | None = None,
    slope: np.ndarray | float | None = None,
) -> np.ndarray:
    """Similarity-weighted mean (knn_weights) of the k most similar training items' values (sim: test × train); with
    a `width` or a `slope`, `sizes` holds the update profiles of the test and the training items (rows of
    zoo.domain.sizes.PROFILE, or sizes alone: its first column), the width weighing by the first column. A `slope` adds
    slope · (the test item's profile − its neighbours' weighed mean profile), over the profile's first len(slope)
    columns: within one task a run's value rises with how far it went, which a mean of its task's neighbours cannot
    say (trend_slope)."""
    out = np.zeros(len(sim))
    test, train = (None, None) if sizes is None else (columns(sizes[0]), columns(sizes[1]))
    beta = None if slope is None else np.atleast_1d(np.asarray(slope, np.float64))
    for i, row in enumerate(sim):
        top = top_k(row, k)
        gaps = None if train is None or test is None or width is None else train[top, 0] - test[i, 0]
        weights = knn_weights(row[top], temperature, gaps, width)
        out[i] = weighted_mean(train_values[top], weights)
        if beta is not None and train is not None and test is not None:
            d = len(beta)
            out[i] += float((test[i, :d] - weights @ train[top, :d] / weights.sum()) @ beta)
    return out


def columns(profiles: np.ndarray) -> np.ndarray:
    """Update profiles as rows (n, d): sizes alone (n,) are one column."""
    a = np.asarray(profiles, np.float64)
    return a[:, None] if a.ndim == 1 else a


#: the ridge of trend_slope, as a share of each column's gap energy: a single column's slope shrunk by 1 / (1 + TREND_RIDGE)
TREND_RIDGE = 1.0


def trend_slope(
    sim: np.ndarray, values: np.ndarray, profiles: np.ndarray, k: int = KNN_K, temperature: float | None = None, width: float | None = None
) -> np.ndarray:
    """The slope knn_regress follows, fitted on labelled items (sim: among them, values and update profiles theirs, or
    sizes alone): each item's value less its leave-one-out kNN mean, regressed through 0 on its profile less its
    neighbours' weighed mean profile, by ridge regression with each column's penalty TREND_RIDGE times its gaps'
    energy (so the columns' units do not matter). 0 for a column whose gaps vanish."""
    rows = columns(profiles)
    n, d = rows.shape
    if n < 2:
        return np.zeros(d)
    residuals, gaps = np.zeros(n), np.zeros((n, d))
    for i in range(n):
        others = np.delete(np.arange(n), i)  # an item is not its own neighbour
        row = np.asarray(sim[i], np.float64)[others]
        top = top_k(row, k)
        found = others[top]
        weights = knn_weights(row[top], temperature, None if width is None else rows[found, 0] - rows[i, 0], width)
        residuals[i] = values[i] - weighted_mean(values[found], weights)
        gaps[i] = rows[i] - weights @ rows[found] / weights.sum()
    energy = (gaps**2).sum(axis=0)
    kept = energy > 0
    slope = np.zeros(d)
    if kept.any():
        g = gaps[:, kept]
        slope[kept] = np.linalg.solve(g.T @ g + TREND_RIDGE * np.diag(energy[kept]), g.T @ residuals)
    return slope


def weighted_mean(values: np.ndarray, weights: np.ndarray) -> float:
    """Σ w·v / Σ w, written as an offset from the first value: neighbours that agree give their value exactly (one
    neighbour's value, not v·w/w), so equal predictions stay equal whatever the weights' rounding."""
    v0 = float(values[0])
    return v0 + float((weights * (values - v0)).sum() / weights.sum())


def classification(pred: list[str], true: list[str]) -> dict[str, float]:
    from sklearn.metrics import f1_score  # imported here: every `zoo` command loads this module, few score

    return {
        "attr_acc": float(np.mean([p == t for p, t in zip(pred, true, strict=True)])),
        "attr_macro_f1": float(f1_score(true, pred, average="macro")),
    }


def regression(pred: np.ndarray, true: np.ndarray) -> dict[str, float]:
    from scipy.stats import kendalltau, spearmanr  # imported here: every `zoo` command loads this module, few score

    return {
        "perf_mae": float(np.abs(pred - true).mean()),
        "perf_spearman": float(spearmanr(pred, true).statistic),
        "perf_kendall": float(kendalltau(pred, true).statistic),
    }


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.maximum(np.linalg.norm(a, axis=1, keepdims=True), 1e-12)
    b = b / np.maximum(np.linalg.norm(b, axis=1, keepdims=True), 1e-12)
    return a @ b.T
