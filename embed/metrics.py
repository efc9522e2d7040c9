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
    """`retrieval`'s metrics per query (0 for a query with no relevant item)."""
    out = {k: np.zeros(len(sim)) for k in ("hit@1", "hit@10", "mrr", "ndcg@10")}
    g_labels = np.array(gallery_labels)
    discounts = 1.0 / np.log2(np.arange(2, 12))
    for q, row in enumerate(sim):
        scores = row.astype(np.float64).copy()
        if self_index[q] is not None:
            scores[self_index[q]] = -np.inf
        order = np.argsort(-scores, kind="stable")
        if self_index[q] is not None:
            order = order[:-1]
        rel = (g_labels[order] == query_labels[q]).astype(np.float64)
        n_rel = int(rel.sum())
        if n_rel == 0:
            continue
        out["hit@1"][q] = rel[0]
        out["hit@10"][q] = float(rel[:10].any())
        out["mrr"][q] = 1.0 / (int(np.argmax(rel)) + 1)
        dcg = float((rel[:10] * discounts[: len(rel[:10])]).sum())
        out["ndcg@10"][q] = dcg / float(discounts[: min(10, n_rel)].sum())
    return out


def top_k(row: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k largest values, best first: a partial sort (O(n)), then a sort of those k."""
    if len(row) > k:
        part = np.argpartition(-row, k - 1)[:k]
        return part[np.argsort(-row[part], kind="stable")]
    return np.argsort(-row, kind="stable")


def knn_vote_shares(sim: np.ndarray, train_classes: np.ndarray, n_classes: int, k: int = KNN_K) -> np.ndarray:
    """Per row of sim (test × train), the class shares of the similarity-weighted vote of the k most similar
    training items with a known class (train_classes: class index per column, -1 unknown); a row with no known
    neighbour gets zeros."""
    sim = np.atleast_2d(sim)
    known = np.flatnonzero(np.asarray(train_classes) >= 0)
    out = np.zeros((len(sim), n_classes))
    if not len(known):
        return out
    classes = np.asarray(train_classes)[known]
    for i, row in enumerate(sim[:, known]):
        top = top_k(row, k)
        np.add.at(out[i], classes[top], np.maximum(row[top], 0.0) + 1e-6)
        out[i] /= out[i].sum()
    return out


def knn_classify(sim: np.ndarray, train_labels: list[str], k: int = KNN_K) -> list[str]:
    """Similarity-weighted vote of the k most similar training items (sim: test × train)."""
    classes = sorted(set(train_labels))
    at = {c: i for i, c in enumerate(classes)}
    index = np.array([at[label] for label in train_labels])
    return [classes[int(i)] for i in knn_vote_shares(sim, index, len(classes), k).argmax(axis=1)]


def knn_regress(sim: np.ndarray, train_values: np.ndarray, k: int = KNN_K) -> np.ndarray:
    """Similarity-weighted mean of the k most similar training items' values (sim: test × train)."""
    out = np.zeros(len(sim))
    for i, row in enumerate(sim):
        top = top_k(row, k)
        out[i] = weighted_mean(train_values[top], np.maximum(row[top], 0.0) + 1e-6)
    return out


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
