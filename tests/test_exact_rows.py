"""A search whose scores come from the input-Gram sketches' 8-bit store ranks its top k by the database's float32
vectors: the candidates near the k-th are scored again from them (embed/serving/exact_rows.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import insert, select

from embed.data.types import SpaceSchema
from embed.serving.engine import QueryEngine
from embed.serving.exact_rows import near_kth
from embed.serving.results import Query
from embed.serving.search_methods import GRAM, SKETCH
from zoo.domain.similarity import sketch_module_cosines
from zoo.store.blobs import BlobStore
from zoo.store.session import session_factory

MODULES, WIDTH = 4, 16


def family_sketches(n: int, seed: int) -> np.ndarray:
    """Module sketches of a zoo of near-copies: 40 families whose members are a few 1e-4 apart in cosine, closer than
    an 8-bit store's rounding (about 1e-3 here), as a million real adapters' neighbours are. A family lacks one module
    in five (zero blocks), as adapters trained on other target modules do."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((40, MODULES * WIDTH))
    centres.reshape(40, MODULES, WIDTH)[rng.uniform(size=(40, MODULES)) < 0.2] = 0.0
    family = rng.integers(0, 40, n)
    x = centres[family] + 0.02 * rng.standard_normal((n, MODULES * WIDTH)) * (centres[family] != 0)
    return x.astype(np.float32)


@pytest.fixture
def eight_bit_space(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[QueryEngine, dict[str, np.ndarray]]:
    """A space of 3,000 adapters whose module-sketch and input-Gram sketch indexes are IVFs with 8-bit stores, and no
    module store (no stored factors): its module cosine and input Gram are estimated from the sketches."""
    from embed.serving import index_files, index_rows
    from zoo.store.embedders import register
    from zoo.store.embeddings import store_embeddings
    from zoo.store.models import Adapter
    from zoo.store.spaces import ensure_space

    monkeypatch.setattr(index_rows, "STORE_8BIT_FROM_DIM", 32)
    monkeypatch.setattr(index_files, "IVF_FROM", 1_000)
    n = 3_000
    vectors = {SKETCH: family_sketches(n, seed=0), GRAM: family_sketches(n, seed=1)}
    modules = [(f"m{j}", 4, 4) for j in range(MODULES)]
    with session_factory(db_url)() as session, session.begin():
        row = {"base_model": "tiny", "format": "peft", "structure_hash": "s", "file_sha256": "f", "size_bytes": 1}
        session.execute(insert(Adapter), [{**row, "name": f"a{i}", "source_uri": f"/a{i}", "canonical_hash": f"h{i}"} for i in range(n)])
        ids = sorted(session.scalars(select(Adapter.id)))
        space = ensure_space(session, "tiny", modules)
        schema = SpaceSchema.from_dict({"base_model": "tiny", "modules": [list(m) for m in modules]})
        for kind, v in vectors.items():
            embedder = register(session, space, kind, MODULES * WIDTH, config={"schema": schema.as_dict(), "dim": WIDTH})
            store_embeddings(session, embedder, ids, v)
    engine = QueryEngine(session_factory(db_url), BlobStore(tmp_path / "blobs"), tmp_path / "data")
    with session_factory(db_url)() as session:
        embedders = engine.space(session, "tiny").embedders
    assert all(embedders[kind].index.ivf and embedders[kind].index.store == "8-bit" for kind in vectors)
    for kind in vectors:  # every list: the candidates hold the exact top 10, and what is tested is their order
        embedders[kind].index.ivf_base.nprobe = embedders[kind].index.ivf_base.nlist
    return engine, vectors


def test_the_input_gram_top_k_and_its_scores_are_the_float32_vectors(
    eight_bit_space: tuple[QueryEngine, dict[str, np.ndarray]], db_url: str
) -> None:
    """The input Gram estimated from its 8-bit sketches: the top 10 and every score of it are what the float32 vectors
    give, for queries whose neighbours are closer than the store's rounding. Module cosine, estimated from the module
    sketches, keeps the store's scores (not read again: EXACT_ROWS)."""
    engine, vectors = eight_bit_space
    with session_factory(db_url)() as session:
        embedders = engine.space(session, "tiny").embedders
        rounded = 0
        for q in range(1, 3_001, 150):
            found = engine.similar(session, "tiny", Query(f"a{q - 1}", q), 10, method="input_gram")["results"]
            got = np.array([r["adapter_id"] for r in found])
            exact = sketch_module_cosines(vectors[GRAM][q - 1 : q], vectors[GRAM], MODULES)[0]
            stored = embedders[GRAM].index
            from_store = sketch_module_cosines(stored.vectors(np.array([q])), stored.vectors(got), MODULES)[0]
            exact[q - 1] = -np.inf
            want = np.argsort(-exact, kind="stable")[:10] + 1
            assert np.allclose([r["score"] for r in found], exact[got - 1], atol=1e-6)
            assert np.allclose(exact[got - 1], exact[want - 1], atol=1e-6)  # the exact top 10, ties aside
            rounded += not np.allclose(from_store, exact[got - 1], atol=1e-6)
            module = engine.similar(session, "tiny", Query(f"a{q - 1}", q), 10, method="module")["results"]
            sketch = embedders[SKETCH].index
            ids = np.array([r["adapter_id"] for r in module])
            kept = sketch_module_cosines(sketch.vectors(np.array([q])), sketch.vectors(ids), MODULES)[0]
            assert np.allclose([r["score"] for r in module], kept, atol=1e-6)
    assert rounded >= 10  # the store alone would have answered other scores


@settings(max_examples=200, deadline=None)
@given(
    scores=st.lists(st.floats(-1, 1, allow_nan=False), min_size=1, max_size=60),
    depth=st.integers(1, 20),
    margin=st.floats(0, 0.5),
)
def test_near_kth_keeps_the_top_depth_and_whatever_could_pass_it(scores: list[float], depth: int, margin: float) -> None:
    """The positions read again: the `depth` best and every score within `margin` of the depth-th, nothing else."""
    s = np.array(scores)
    near = set(near_kth(s, depth, margin).tolist())
    order = np.argsort(-s, kind="stable")
    assert set(order[:depth].tolist()) <= near
    kth = s[order[min(depth, len(s)) - 1]]
    assert near == {i for i in range(len(s)) if s[i] >= kth - margin} or len(s) <= depth
