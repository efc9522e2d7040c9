"""The query engine (embed/serving/engine.py) against real databases, real PEFT adapters and a second real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import select

from embed.serving import index_files
from embed.serving.engine import QueryEngine
from embed.serving.results import Query
from tests.conftest import CLI
from tests.factories import train_peft_adapter
from zoo.domain.similarity import dw_cosine_matrix, module_cosine_matrix
from zoo.errors import NotReadyError, UsageError
from zoo.limits import MAX_K
from zoo.store.blobs import BlobStore
from zoo.store.models import Label
from zoo.store.session import session_factory


@pytest.fixture(scope="module")
def twenty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 real PEFT adapters in two batches (first/, later/) with labels: task qk or qv, a colour."""
    root = tmp_path_factory.mktemp("engine-zoo")
    rows = ["name,task,colour,test_accuracy"]
    for i in range(20):
        targets = ("q_proj", "v_proj") if i % 2 else ("q_proj", "k_proj")
        train_peft_adapter(root / ("first" if i < 14 else "later") / f"e{i:02d}", seed=100 + i, steps=4, targets=targets)
        rows.append(f"e{i:02d},{'qv' if i % 2 else 'qk'},{'red' if i % 3 == 0 else 'blue'},{0.5 + i / 50}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root


def ingest_and_embed(cli: CLI, zoo: Path, part: str) -> None:
    rc, _ = cli.json_lines("ingest", str(zoo / part), "--labels", str(zoo / "labels.csv"), "--base-model", "tiny")  # and embedded
    assert rc == 0


def make_engine(cli: CLI) -> QueryEngine:
    return QueryEngine(session_factory(cli.settings.database_url), BlobStore(cli.settings.blob_dir), cli.settings.data_dir)


def ids_of(found: dict) -> list[int]:
    return [r["adapter_id"] for r in found["results"]]


def stored_factors(cli: CLI, ids: list[int]) -> list[dict]:
    from zoo.store.models import Adapter

    blobs = BlobStore(cli.settings.blob_dir)
    with session_factory(cli.settings.database_url)() as session:
        return [dict(blobs.get_factors(str(session.get(Adapter, i).factors_blob))) for i in ids]


@pytest.mark.slow  # two `zoo` processes, each importing torch
def test_engine_sees_embeddings_written_by_another_process(cli: CLI, twenty: Path) -> None:
    ingest_and_embed(cli, twenty, "first")
    engine = make_engine(cli)
    with session_factory(cli.settings.database_url)() as session:
        before = engine.similar(session, "tiny", Query("e00", 1), MAX_K, method="sketch")
        state = engine.space(session, "tiny")
        version = state.version
    assert len(before["results"]) == 13
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    base = [sys.executable, "-m", "zoo.cli", "--db", cli.settings.database_url, "--data-dir", str(cli.settings.data_dir)]
    subprocess.run(
        [*base, "ingest", "--no-embed", str(twenty / "later"), "--labels", str(twenty / "labels.csv"), "--base-model", "tiny", "--json"],
        check=True,
        env=env,
        capture_output=True,
    )
    out = subprocess.run([*base, "embed", "--json"], check=True, env=env, capture_output=True, text=True).stdout
    assert json.loads(out)[0]["embedded"] == 6
    with session_factory(cli.settings.database_url)() as session:
        after = engine.similar(session, "tiny", Query("e00", 1), MAX_K, method="module")
        assert engine.space(session, "tiny") is state and state.version > version  # the same state, refreshed in place
    assert len(after["results"]) == 19 and after["module_stage"] == "exact (module store)"
    assert state.modules is not None and len(state.modules.rows) == 20  # the new adapters' factors were added, not reloaded
    # the refreshed engine ranks exactly as a fresh one that loads the files `zoo embed` wrote
    with session_factory(cli.settings.database_url)() as session:
        fresh = make_engine(cli).similar(session, "tiny", Query("e00", 1), MAX_K, method="module")
    assert ids_of(after) == ids_of(fresh)
    assert np.allclose([r["score"] for r in after["results"]], [r["score"] for r in fresh["results"]], atol=1e-5)


def test_concurrent_queries_agree_with_serial_ones(cli: CLI, twenty: Path) -> None:
    ingest_and_embed(cli, twenty, "first")
    ingest_and_embed(cli, twenty, "later")
    engine = make_engine(cli)
    jobs = [(i, method) for i in range(1, 21) for method in ("module", "sketch")]

    def run(job: tuple[int, str]) -> list[int]:
        with session_factory(cli.settings.database_url)() as session:
            return ids_of(engine.similar(session, "tiny", Query(f"e{job[0]}", job[0]), 5, method=job[1]))

    serial = [run(j) for j in jobs]
    with ThreadPoolExecutor(8) as pool:
        threaded = list(pool.map(run, jobs * 3))
    assert threaded == serial * 3


@pytest.mark.parametrize("method", ["module", "dw", "sketch"])
def test_filtered_results_equal_brute_force(cli: CLI, twenty: Path, method: str) -> None:
    ingest_and_embed(cli, twenty, "first")
    ingest_and_embed(cli, twenty, "later")
    engine = make_engine(cli)
    filters = {"task": "qv", "colour": "blue"}
    with session_factory(cli.settings.database_url)() as session:
        found = engine.similar(session, "tiny", Query("e01", 2), 4, filters, method)
        state = engine.space(session, "tiny")
        labels: dict[int, dict[str, str]] = {}
        for adapter_id, key, value in session.execute(select(Label.adapter_id, Label.key, Label.value)).all():
            labels.setdefault(adapter_id, {})[key] = value
    allowed = sorted(i for i, lb in labels.items() if lb["task"] == "qv" and lb["colour"] == "blue" and i != 2)
    assert len(allowed) >= 4 and all(labels[i]["task"] == "qv" for i in ids_of(found))
    if method == "module":
        exact = module_cosine_matrix(stored_factors(cli, [2]), stored_factors(cli, allowed))[0]
    elif method == "dw":
        exact = dw_cosine_matrix(stored_factors(cli, [2]), stored_factors(cli, allowed))[0]
    else:
        vectors = state.embedders["module_sketch"].index.vectors(np.array([2, *allowed]))
        exact = vectors[1:] @ vectors[0]
    want = [allowed[j] for j in np.argsort(-exact, kind="stable")[:4]]
    assert ids_of(found) == want
    assert np.allclose([r["score"] for r in found["results"]], np.sort(exact)[::-1][:4], atol=1e-5)


def test_engine_sees_label_changes_without_a_restart(cli: CLI, twenty: Path, tmp_path: Path) -> None:
    ingest_and_embed(cli, twenty, "first")
    engine = make_engine(cli)
    sessions = session_factory(cli.settings.database_url)

    def green() -> dict:
        with sessions() as session:
            return engine.similar(session, "tiny", Query("e00", 1), MAX_K, {"colour": "green"}, "sketch")

    assert green()["results"] == []
    (tmp_path / "relabel.csv").write_text("name,colour\ne03,green\ne05,green\n")
    rc, _ = cli.json_lines(
        "ingest",
        str(twenty / "first" / "e03"),
        str(twenty / "first" / "e05"),
        "--labels",
        str(tmp_path / "relabel.csv"),
        "--base-model",
        "tiny",
    )
    assert rc == 0
    after = green()
    assert sorted(ids_of(after)) == [4, 6] and all(r["labels"] == {"task": "qv", "colour": "green"} for r in after["results"])
    with sessions() as session:  # e03 was red: the old value no longer matches it
        red = engine.similar(session, "tiny", Query("e00", 1), MAX_K, {"colour": "red"}, "sketch")
    assert 4 not in ids_of(red) and {r["labels"]["colour"] for r in red["results"]} == {"red"}


def test_k_cap_unknown_filter_values_and_large_stale_indexes(cli: CLI, twenty: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ingest_and_embed(cli, twenty, "first")
    engine = make_engine(cli)
    with session_factory(cli.settings.database_url)() as session:
        with pytest.raises(UsageError, match="k must be between"):
            engine.similar(session, "tiny", Query("e00", 1), MAX_K + 1)
        assert engine.similar(session, "tiny", Query("e00", 1), 5, {"task": "no such task"})["results"] == []
        with pytest.raises(UsageError, match="rank"):
            engine.similar(session, "tiny", Query("e00", 1), 5, {"rank": "four"})
        assert len(engine.similar(session, "tiny", Query("e00", 1), 5, {"rank": "4", "format": "peft"})["results"]) == 5
    for path in (cli.settings.data_dir / "index").glob("*.index"):
        path.write_bytes(b"damaged")  # (a missing one is this node's cache to build: test_s3_blobs.py)
    monkeypatch.setattr(index_files, "IVF_FROM", 10)  # too many vectors to answer from the database
    with session_factory(cli.settings.database_url)() as session, pytest.raises(NotReadyError, match="zoo index rebuild"):
        make_engine(cli).similar(session, "tiny", Query("e00", 1), 5)


def test_a_space_over_the_module_store_budget_ranks_by_module_sketches(cli: CLI, twenty: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZOO_MODULE_STORE_BYTES", "1000")
    rc, _ = cli.json_lines("ingest", "--no-embed", str(twenty / "first"), "--labels", str(twenty / "labels.csv"), "--base-model", "tiny")
    rc, (reports,) = cli.json_lines("embed")
    assert reports[0]["module_store"].startswith("none (") and "ZOO_MODULE_STORE_BYTES" in reports[0]["module_store"]
    engine = make_engine(cli)
    with session_factory(cli.settings.database_url)() as session:
        found = engine.similar(session, "tiny", Query("e00", 1), 13, method="module")
        vectors = engine.space(session, "tiny").embedders["module_sketch"].index.vectors(np.arange(1, 15))
    assert found["module_stage"] == "module sketches (no module store)"
    from zoo.domain.similarity import sketch_module_cosines

    n_modules = vectors.shape[1] // 64
    want = sketch_module_cosines(vectors[:1], vectors[1:], n_modules)[0]
    assert [r["adapter_id"] for r in found["results"]] == (np.argsort(-want, kind="stable") + 2).tolist()
    exact = module_cosine_matrix(stored_factors(cli, [1]), stored_factors(cli, list(range(2, 15))))[0]
    assert np.corrcoef(want, exact)[0, 1] > 0.9  # the sketches track the exact module cosine


def test_a_search_with_a_second_stage_serves_the_top_of_its_first_in_the_order_of_its_second(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A W2T checkpoint whose chosen search has a second stage (zoo.domain.methods.SearchScore): hybrid search returns
    the top of the first mix of the module cosine and the W2T cosine re-ordered by the second mix, then the rest in
    the first mix's order, each with its first-stage score; both cosines as the engine serves them alone."""
    from tests.conftest import copy_seeded
    from zoo.config import Settings
    from zoo.domain.methods import SearchScore

    zoo = copy_seeded(request, "sqlite", tmp_path)
    settings = Settings.load(zoo.url, zoo.data_dir)
    engine = QueryEngine(session_factory(settings.database_url), BlobStore(settings.blob_dir), settings.data_dir)
    staged = SearchScore("module", 0.8, 0.1, 8)
    with session_factory(settings.database_url)() as session:
        checkpoint = settings.data_dir / str(engine.space(session, "tiny").embedders["w2t"].checkpoint)
        meta = json.loads((checkpoint / "embedder.json").read_text())
        (checkpoint / "embedder.json").write_text(json.dumps({**meta, "search": staged.name}))
        found = {m: engine.similar(session, "tiny", Query("w01", 1), 11, method=m) for m in ("hybrid", "module", "w2t")}
    module, w2t = ({r["adapter_id"]: r["score"] for r in found[m]["results"]} for m in ("module", "w2t"))
    assert set(module) == set(w2t) == set(ids_of(found["hybrid"])) and len(module) == 11
    first = {i: 0.2 * module[i] + 0.8 * w2t[i] for i in module}
    second = {i: 0.9 * module[i] + 0.1 * w2t[i] for i in module}
    by_first = sorted(first, key=lambda i: -first[i])
    want = sorted(by_first[:8], key=lambda i: -second[i]) + by_first[8:]
    assert want != by_first  # the second stage moves something here: the test tells the stages apart
    assert ids_of(found["hybrid"]) == want
    assert all(r["score"] == pytest.approx(first[r["adapter_id"]], abs=1e-5) for r in found["hybrid"]["results"])


def test_a_space_of_vectors_without_stored_factors_serves_from_its_sketches(cli: CLI, twenty: Path) -> None:
    """A space whose vectors were written with no module rows and no blobs (bench/serve.py's synthetic spaces): a node
    without a module store builds none, reads no blob, and ranks by the module sketches."""
    import shutil

    from sqlalchemy import delete

    from embed.serving.module_store import module_store_path
    from zoo.store.models import Module

    ingest_and_embed(cli, twenty, "first")
    with session_factory(cli.settings.database_url)() as session:
        session.execute(delete(Module))
        session.commit()
    shutil.rmtree(cli.settings.blob_dir)
    for store in module_store_path(cli.settings.data_dir, 1).parent.glob("*"):
        store.unlink()
    engine = make_engine(cli)
    with session_factory(cli.settings.database_url)() as session:
        found = engine.similar(session, "tiny", Query("e00", 1), 5, method="module")
    assert found["module_stage"] == "module sketches (no module store)" and len(found["results"]) == 5
    assert not any(module_store_path(cli.settings.data_dir, 1).parent.glob("*"))


def test_the_raw_factor_index_opens_when_a_query_first_needs_it(cli: CLI, twenty: Path) -> None:
    """A space loads without its raw-factor index (DEFERRED: no default search reads it); `--method raw` and the
    relation step's neighbours open it then, as the database has it: an adapter deleted after the space loaded is
    not answered, and the space's bytes count the index once it is open."""
    from embed.serving.adapter_resource import delete_adapter
    from embed.serving.search_methods import RAW

    ingest_and_embed(cli, twenty, "first")
    engine = make_engine(cli)
    sessions = session_factory(cli.settings.database_url)
    with sessions() as session:
        state = engine.space(session, "tiny")
        assert RAW not in state.embedders and set(state.deferred) == {RAW}
        closed = engine.loaded_spaces()["tiny"]
        assert len(ids_of(engine.similar(session, "tiny", Query("e00", 1), 5))) == 5  # the default search: still closed
        assert RAW in state.deferred
    delete_adapter(sessions, 2)
    with sessions() as session:
        found = engine.similar(session, "tiny", Query("e00", 1), 13, method="raw")
        assert RAW in state.embedders and not state.deferred
        assert 2 not in ids_of(found) and len(ids_of(found)) == 12
        assert engine.loaded_spaces()["tiny"] > closed
        neighbours = engine.stored_neighbours(session, "tiny", "raw", [1, 3], 3)
    assert ids_of(found)[:3] == [i for i, _ in neighbours[1]] and 2 not in [i for i, _ in neighbours[3]]
