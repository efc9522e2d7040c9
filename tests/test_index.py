"""FAISS index: add/search/remove/save/load, agreement with a brute-force numpy search."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from embed.index import AdapterIndex, brute_force, checksum, recall_at_k


def data(n: int = 500, dim: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.choice(10_000, size=n, replace=False).astype(np.int64), rng.standard_normal((n, dim)).astype(np.float32)


def test_exact_search_matches_brute_force() -> None:
    ids, vecs = data()
    index = AdapterIndex.build(ids, vecs)
    assert not index.approximate and index.size == 500
    queries = np.random.default_rng(1).standard_normal((20, 32)).astype(np.float32)
    scores, got = index.search(queries, 10)
    ref_scores, ref = brute_force(ids, vecs, queries, 10)
    assert np.array_equal(got, ref)
    assert np.allclose(scores, ref_scores, atol=1e-5)
    assert np.all(scores <= 1.0 + 1e-5)


def test_remove_and_duplicate_ids() -> None:
    ids, vecs = data()
    index = AdapterIndex.build(ids, vecs)
    assert index.remove(ids[:10]) == 10
    _, got = index.search(vecs[:10], 5)
    assert not set(got.flatten().tolist()) & set(ids[:10].tolist())
    with pytest.raises(ValueError, match="already in the index"):
        index.add(ids[20:21], vecs[20:21])
    index.add(ids[:10], vecs[:10])
    _, got = index.search(vecs[:3], 1)
    assert got[:, 0].tolist() == ids[:3].tolist()


def test_save_load_round_trip_and_checksum(tmp_path: Path) -> None:
    ids, vecs = data()
    index = AdapterIndex.build(ids, vecs)
    index.save(tmp_path / "space.faiss", checksum(ids, vecs))
    loaded, meta = AdapterIndex.load(tmp_path / "space.faiss")
    assert meta["count"] == loaded.size == 500 and meta["checksum"] == checksum(ids, vecs)
    q = vecs[:5]
    assert np.array_equal(loaded.search(q, 7)[1], index.search(q, 7)[1])
    assert checksum(ids[::-1], vecs[::-1]) == checksum(ids, vecs)
    assert checksum(ids, vecs + 0.1) != checksum(ids, vecs)
    assert not list(tmp_path.glob(".tmp-*"))


def test_hnsw_recall_and_no_removal(tmp_path: Path) -> None:
    ids, vecs = data(n=3000, dim=16)
    index = AdapterIndex.build(ids, vecs, approximate=True)
    queries = vecs[:100] + 0.05 * np.random.default_rng(2).standard_normal((100, 16)).astype(np.float32)
    _, approx = index.search(queries, 10)
    _, exact = brute_force(ids, vecs, queries, 10)
    assert recall_at_k(approx, exact) > 0.9
    with pytest.raises(NotImplementedError, match="rebuild"):
        index.remove(ids[:1])
    index.save(tmp_path / "h.faiss", "x")
    loaded, _ = AdapterIndex.load(tmp_path / "h.faiss")
    assert np.array_equal(loaded.search(queries, 10)[1], approx)
