"""The engine factors a module store's dense modules once (embed/serving/dense_svd.py): a query's input Gram and channel
metric scores are what factoring its candidates afresh gives, a second query factors nothing again, and a store that
drops a deleted adapter and takes a new one serves neither's factors for the other."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from embed.serving.adapter_resource import delete_adapter
from embed.serving.dense_svd import DenseSVD
from embed.serving.engine import QueryEngine
from embed.serving.module_store import ModuleStore
from embed.serving.results import Query
from tests.conftest import CLI
from tests.factories import write_random_peft_adapters
from zoo.domain.channel_metric import ChannelMetric, bank_matrices
from zoo.domain.channels import DENSE_CUTOFF, dense_svd, module_factors
from zoo.domain.exact_scores import exact_cosines
from zoo.domain.similarity import ModuleStack
from zoo.limits import MAX_K
from zoo.store.blobs import BlobStore
from zoo.store.session import session_factory

N = 12


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """N TinyLM adapters under zoo/ (r 4 on 16 × 16 modules: every module is kept dense) and one more under later/."""
    root = tmp_path_factory.mktemp("dense-svd")
    made = write_random_peft_adapters(root / "made", N + 1, seed=54)
    rows = ["name,task"]
    for i, path in enumerate(made):
        shutil.move(path, root / ("zoo" if i < N else "later") / f"s{i:02d}")
        rows.append(f"s{i:02d},{'ab'[i % 2]}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root


def ingest_and_embed(cli: CLI, pool: Path, path: Path) -> list[int]:
    rc, results = cli.json_lines("ingest", str(path), "--labels", str(pool / "labels.csv"), "--base-model", "tiny")  # and embedded
    assert rc == 0 and all(r["status"] == "ingested" for r in results), results
    return [r["adapter_id"] for r in results]


def engine_of(cli: CLI) -> QueryEngine:
    return QueryEngine(session_factory(cli.settings.database_url), BlobStore(cli.settings.blob_dir), cli.settings.data_dir)


def search(engine: QueryEngine, cli: CLI, query: int) -> dict[int, float]:
    with session_factory(cli.settings.database_url)() as session:
        found = engine.similar(session, "tiny", Query("q", query), MAX_K, method="input_gram")
    return {r["adapter_id"]: r["score"] for r in found["results"]}


def store_of(engine: QueryEngine, cli: CLI) -> ModuleStore:
    with session_factory(cli.settings.database_url)() as session:
        store = engine.space(session, "tiny").modules
    assert store is not None and store.dense  # the exact stage, with dense modules to factor
    return store


def uncached(store: ModuleStore, query: int, ids: list[int]) -> tuple[ModuleStack, ModuleStack]:
    """(gallery, query) stacks of the store's rows without any SVD: what each query factored before."""
    return store.stack.take([store.rows[i] for i in ids]), store.stack.take([store.rows[query]])


@pytest.fixture
def svd_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many matrices each call of numpy's SVD factors, call by call."""
    calls: list[int] = []
    svd = np.linalg.svd

    def counted(a: np.ndarray, *args: object, **kwargs: object) -> object:
        calls.append(int(np.prod(np.shape(a)[:-2])))
        return svd(a, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(np.linalg, "svd", counted)
    return calls


def test_each_row_is_factored_once_and_scores_as_if_factored_afresh(cli: CLI, pool: Path, svd_rows: list[int]) -> None:
    ids = ingest_and_embed(cli, pool, pool / "zoo")
    engine = engine_of(cli)
    first = search(engine, cli, ids[0])
    assert set(first) == set(ids[1:]) and sum(svd_rows) > 0  # every other adapter is a candidate, factored here
    svd_rows.clear()
    second = search(engine, cli, ids[1])
    assert svd_rows == []  # the same candidates: nothing factored again (before: every candidate, every query)

    store = store_of(engine, cli)
    others = [i for i in ids if i != ids[1]]
    gallery, query = uncached(store, ids[1], others)
    want = exact_cosines(gallery, query, "input_gram")[0]
    assert [second[i] for i in others] == want.tolist()  # exactly, not approximately

    # a channel metric over every atom (Grams, subspaces, spectra, module and dW cosine) scores as uncached, exactly
    bank = bank_matrices(store.stack, store.stack)
    weights = np.random.default_rng(0).uniform(0.1, 1.0, len(bank.atoms))
    metric = ChannelMetric("search", bank.atoms, weights, "input_gram", 1.0, bank.modules)
    svd_rows.clear()
    cached = metric.between(store.take(others), store.take([ids[1]]))
    assert svd_rows == []
    np.testing.assert_array_equal(cached, metric.between(gallery, query))


def test_a_deleted_adapter_leaves_the_cache_and_a_new_one_is_factored_afresh(cli: CLI, pool: Path) -> None:
    ids = ingest_and_embed(cli, pool, pool / "zoo")
    engine = engine_of(cli)
    search(engine, cli, ids[0])  # every row factored
    assert store_of(engine, cli).svd.factored() == N  # type: ignore[union-attr]  # set by ModuleStore
    gone = ids[3]
    delete_adapter(session_factory(cli.settings.database_url), gone)
    (new,) = ingest_and_embed(cli, pool, pool / "later")

    store = store_of(engine, cli)  # caught up: the deleted row dropped, the new one appended, unfactored
    assert gone not in store.rows and new in store.rows
    assert store.svd is not None and store.svd.factored() == N - 1
    found = search(engine, cli, ids[0])
    assert gone not in found and new in found
    store = store_of(engine, cli)
    assert store.svd is not None and store.svd.factored() == N
    # every row's factors are its own dW's: the carried rows moved with their adapters
    held = store.take(sorted(store.rows))
    fresh = store.stack.take([store.rows[i] for i in sorted(store.rows)])
    assert set(held.svd) == set(fresh.dense)
    for name, dense in fresh.dense.items():
        U, V, S = dense_svd(dense)
        width = held.svd[name][2].shape[1]
        assert width < S.shape[1] and (S[:, width:] <= DENSE_CUTOFF).all()  # the components some row keeps, no more
        for a, b in zip(held.svd[name], (U, V, S), strict=True):
            np.testing.assert_array_equal(a, b[:, :width])
        for a, b in zip(module_factors(held, name), module_factors(fresh, name), strict=True):
            np.testing.assert_array_equal(a, b)
    others = sorted(found)
    gallery, query = uncached(store, ids[0], others)
    assert [found[i] for i in others] == exact_cosines(gallery, query, "input_gram")[0].tolist()


def dense_stack(ranks: list[int], seed: int = 0) -> ModuleStack:
    """Rows of unit-norm 12 × 10 updates of the given ranks, one dense module."""
    rng = np.random.default_rng(seed)
    dense = np.zeros((len(ranks), 12, 10), np.float32)
    for j, r in enumerate(ranks):
        dW = rng.normal(size=(12, r)) @ rng.normal(size=(r, 10))
        dense[j] = dW / np.linalg.norm(dW)
    return ModuleStack(len(ranks), {"m": np.ones(len(ranks), np.float32)}, {"m": dense}, {})


def test_rows_of_higher_rank_widen_what_is_held_and_moved_rows_keep_their_own_factors() -> None:
    stack = dense_stack([2, 2, 5, 3, 2])
    cache = DenseSVD(stack)
    assert cache.take([0, 1]).svd["m"][2].shape[1] == 2  # the components some factored row keeps
    wide = cache.take([2, 4])
    assert wide.svd["m"][2].shape[1] == 5 and cache.factored() == 4  # widened: rows 0 and 1 factored again
    for rows in ([0, 1], [2, 4], [4, 0, 2], [3, 1]):
        for a, b in zip(module_factors(cache.take(rows), "m"), module_factors(stack.take(rows), "m"), strict=True):
            np.testing.assert_array_equal(a, b)
    # a new stack of rows 4, 2 and a new row (say, after a delete and an ingest): the old rows carried, the new one not
    grown = ModuleStack.concat([stack.take([4, 2]), dense_stack([4], seed=1)])
    moved = cache.moved(grown, np.array([4, 2, -1]))
    assert moved.factored() == 2
    for a, b in zip(module_factors(moved.take([0, 1, 2]), "m"), module_factors(grown, "m"), strict=True):
        np.testing.assert_array_equal(a, b)
    assert moved.factored() == 3 and cache.factored() == 5
    assert DenseSVD.bound(grown) == 3 * 10 * (12 + 10 + 1) * 4
