"""An IVF index's store (its re-rank copy): 8-bit from STORE_8BIT_FROM_DIM dimensions, float16 below; what each costs
in memory and in cosine error, that an 8-bit store keeps zeros, and that float16 files still load."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import insert, select

from embed.serving.exact_search import normalize, recall_at_k
from embed.serving.index import CANDIDATES, AdapterIndex
from embed.serving.index_files import build_index
from embed.serving.index_rows import STORE_RANGE_MARGIN, store_step, trained_store
from embed.serving.search_methods import GRAM, SKETCH, W2T
from embed.serving.space_state import ID_BYTES, index_bytes


def clustered(n: int, dim: int, seed: int) -> np.ndarray:
    """Unit vectors around 50 centres, as sketches of a zoo of families are (near neighbours a few 1e-4 apart)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((50, dim))
    return normalize((centres[rng.integers(0, 50, n)] + 0.4 * rng.standard_normal((n, dim))).astype(np.float32))


def ivf(vectors: np.ndarray, store: str | None = None) -> AdapterIndex:
    index = AdapterIndex.trained_ivf(vectors, len(vectors), store)
    index.add(np.arange(1, len(vectors) + 1), vectors)
    return index


def test_an_8bit_store_hands_on_the_first_stage_candidates_a_float16_one_does() -> None:
    """An 8-bit store's CANDIDATES nearest hold the exact top 10 as a float16 store's do. Its own top 10 is not the
    exact one on a set this tie-dense (neighbours 1e-4 apart against its 2.7e-4 error): that is why a search whose
    scores come from an 8-bit store orders the candidates near its k-th by the database's float32 vectors
    (tests/test_exact_rows.py)."""
    vectors = clustered(8_000, 48, seed=0)
    queries = normalize(vectors[:100] + 0.05 * np.random.default_rng(1).standard_normal((100, 48)).astype(np.float32))
    exact = np.argsort(-(queries @ vectors.T), axis=1)[:, :10] + 1
    candidates, top10 = {}, {}
    for store in ("fp16", "8-bit"):
        index = ivf(vectors, store)
        assert index.store == store
        index.ivf_base.nprobe = index.ivf_base.nlist  # every list: what differs is the store's re-ranking alone
        candidates[store] = recall_at_k(index.search(queries, CANDIDATES)[1], exact)
        top10[store] = recall_at_k(index.search(queries, 10)[1], exact)
    assert candidates["8-bit"] >= candidates["fp16"] - 0.01 and candidates["8-bit"] >= 0.99
    assert top10["fp16"] >= 0.99 and top10["8-bit"] < top10["fp16"]


@pytest.fixture(scope="module")
def indexes() -> tuple[np.ndarray, dict[str, AdapterIndex]]:
    """2,000 clustered vectors of 32 dimensions in an IVF index with each store."""
    vectors = clustered(2_000, 32, seed=2)
    return vectors, {store: ivf(vectors, store) for store in ("8-bit", "fp16")}


def test_memory_per_vector_is_what_index_bytes_counts(indexes: tuple[np.ndarray, dict[str, AdapterIndex]]) -> None:
    """An 8-bit store takes a byte a dimension, float16 two, and index_bytes (the engine's budget) counts it."""
    _, built = indexes
    assert built["8-bit"].tie == pytest.approx(2 * store_step(built["8-bit"].store_quantizer) / np.sqrt(12))  # its error's 2 sd
    for store, per_dim in (("8-bit", 1), ("fp16", 2)):
        assert built[store].store == store and built[store].store_bytes == per_dim * 32
        assert built[store].store_codes().nbytes == 2_000 * per_dim * 32  # what FAISS holds
        # the store, the list codes (float16 below PQ_FROM_DIM), the subset codes (a byte per 8 dimensions), the id
        assert index_bytes(built[store]) == 2_000 * (per_dim * 32 + 2 * 32 + 4 + ID_BYTES)


@settings(max_examples=30, deadline=None)
@given(
    dim=st.integers(8, 300),
    seed=st.integers(0, 10**6),
    absent=st.floats(0.0, 0.9),  # the share of blocks zero (modules an adapter lacks)
    spread=st.floats(0.5, 4.0),  # how unequal the dimensions' scales are
)
def test_an_8bit_stored_vector_is_within_half_a_step_a_dimension(dim: int, seed: int, absent: float, spread: float) -> None:
    """Every 8-bit stored vector is within √dim · step / 2 of the unit vector added (step: the trained range / 255), so
    any cosine with a unit query is off by at most that, whatever share of its blocks is zero."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((600, dim)) * np.exp(spread * rng.uniform(-0.5, 0.5, dim))
    x *= rng.uniform(size=(600, 1 + dim // 8)).repeat(8, axis=1)[:, :dim] >= absent
    x[np.abs(x).sum(axis=1) == 0, 0] = 1.0
    vectors = normalize(x.astype(np.float32))
    store = trained_store(vectors[:300], "8-bit")  # half of them trained on, as an index trains on a sample
    inside = np.all((vectors >= vectors[:300].min()) & (vectors <= vectors[:300].max()), axis=1)  # the rest: within the margin
    low, width = faiss.vector_to_array(store.sq.trained)
    lowest, highest = vectors[:300].min(), vectors[:300].max()
    margin = STORE_RANGE_MARGIN * (highest - lowest)
    assert low == -width / 2 == pytest.approx(-max(margin - lowest, highest + margin), abs=1e-6)  # symmetric about 0
    assert width == pytest.approx(255 * store_step(store))
    stored = store.sa_decode(store.sa_encode(vectors))
    assert np.linalg.norm(stored - vectors, axis=1)[inside].max() <= np.sqrt(dim) * store_step(store) / 2 * (1 + 1e-4)


@settings(max_examples=20, deadline=None)
@given(dim=st.integers(8, 96), seed=st.integers(0, 10**6), absent=st.floats(0.0, 0.9), tiny=st.floats(0.0, 0.5))
def test_an_8bit_store_keeps_zeros_and_only_zeros(dim: int, seed: int, absent: float, tiny: float) -> None:
    """Through an index's writes (add and upsert), a coordinate is stored as 0 exactly when it is 0, and every other
    within a step of itself: a sketch's absent modules read as absent from the store, and no present one does."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2_000, dim))
    x.reshape(-1)[rng.uniform(size=x.size) < tiny] *= 1e-4  # coordinates inside the zero code's half step
    x *= rng.uniform(size=(2_000, 1 + dim // 8)).repeat(8, axis=1)[:, :dim] >= absent
    x[np.abs(x).sum(axis=1) == 0, 0] = 1.0
    vectors = normalize(x.astype(np.float32))
    index = ivf(vectors, "8-bit")
    index.upsert(np.arange(1, 101), vectors[100:200])
    written = np.concatenate([vectors[100:200], vectors[100:]])
    stored = index.vectors(np.arange(1, 2_001))
    assert np.array_equal(stored == 0, written == 0)
    assert np.abs(stored - written).max() <= store_step(index.store_quantizer) * (1 + 1e-4)


def test_a_float16_store_file_still_loads_searches_and_takes_upserts(
    tmp_path: Path, indexes: tuple[np.ndarray, dict[str, AdapterIndex]]
) -> None:
    """Index files written before 8-bit stores (float16 at every dimension) are served as they are."""
    vectors, built = indexes
    index = built["fp16"]
    index.save(tmp_path / "old.index", {"embedder_id": 1, "version": 1})
    loaded, _ = AdapterIndex.load(tmp_path / "old.index")
    assert loaded.store == "fp16" and loaded.tie == 1e-4
    queries = vectors[:20]
    assert np.array_equal(loaded.search(queries, 10)[1], index.search(queries, 10)[1])
    assert np.allclose(loaded.vectors(np.arange(1, 2_001)), vectors, atol=1e-3)  # > 1,000 rows: decoded in one go
    loaded.upsert(np.array([1]), -vectors[:1])
    assert np.allclose(loaded.vectors(np.array([1])), -vectors[:1], atol=1e-3)
    assert loaded.exact_top(-vectors[:1], 1)[1][0, 0] == 1


def test_build_index_stores_each_embedder_by_its_dimension(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """build_index (zoo index, bench.serve) stores the module and input-Gram sketches in 8 bits (from 32 dimensions
    here, to keep the test small): a search whose scores are their cosines orders its top k by the database's float32
    vectors (embed/serving/exact_rows.py). The W2T embedding, below that dimension, keeps float16."""
    from embed.serving import index_rows
    from zoo.store.embedders import register
    from zoo.store.embeddings import store_embeddings
    from zoo.store.models import Adapter
    from zoo.store.session import session_factory
    from zoo.store.spaces import ensure_space

    monkeypatch.setattr(index_rows, "STORE_8BIT_FROM_DIM", 32)
    n, dim = 2_000, 32
    vectors = clustered(n, dim, seed=6)
    dims = {SKETCH: dim, GRAM: dim, W2T: 16}
    with session_factory(db_url)() as session, session.begin():
        row = {"base_model": "tiny", "format": "peft", "structure_hash": "s", "file_sha256": "f", "size_bytes": 1}
        session.execute(insert(Adapter), [{**row, "name": f"a{i}", "source_uri": f"/a{i}", "canonical_hash": f"h{i}"} for i in range(n)])
        ids = sorted(session.scalars(select(Adapter.id)))
        space = ensure_space(session, "tiny", (("m", 4, 4),))
        embedders = {method: register(session, space, method, d) for method, d in dims.items()}
        for method, embedder in embedders.items():
            store_embeddings(session, embedder, ids, vectors[:, : dims[method]])
    with session_factory(db_url)() as session:
        stores = {method: build_index(session, e, ivf=True).store for method, e in embedders.items()}
    assert stores == {SKETCH: "8-bit", GRAM: "8-bit", W2T: "fp16"}
