"""Deleted means gone: an adapter id is never handed out twice (SQLite too: migration 0011), every
structure keyed by adapter id (the engine's indexes, module store, names and labels; the index files, module store
file and map) drops a deleted adapter, and `zoo check` finds an entry for an id the database no longer has."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from embed.serving.adapter_resource import delete_adapter
from embed.serving.engine import QueryEngine
from embed.serving.index import AdapterIndex
from embed.serving.index_files import index_path
from embed.serving.module_store import module_store_path
from embed.serving.results import Query
from tests.conftest import CLI
from tests.factories import write_random_peft_adapters
from zoo.domain.similarity import dw_cosine_matrix, module_cosine_matrix
from zoo.files import read_derived, write_derived
from zoo.limits import MAX_K
from zoo.store.blobs import BlobStore
from zoo.store.models import Adapter
from zoo.store.session import downgrade, make_engine, session_factory, upgrade

N = 12


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """N adapters under zoo/ (tasks a and b in turn) and two more under later/ (ingested after a delete)."""
    root = tmp_path_factory.mktemp("deleted-ids")
    made = write_random_peft_adapters(root / "made", N + 2, seed=31)
    rows = ["name,task"]
    for i, path in enumerate(made):
        name = f"d{i:02d}"
        shutil.move(path, root / ("zoo" if i < N else "later") / name)
        rows.append(f"{name},{'ab'[i % 2]}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root


def ingest(cli: CLI, pool: Path, path: Path) -> list[int]:
    rc, results = cli.json_lines("ingest", "--no-embed", str(path), "--labels", str(pool / "labels.csv"), "--base-model", "tiny")
    assert rc == 0 and all(r["status"] == "ingested" for r in results), results
    return [r["adapter_id"] for r in results]


def factors(cli: CLI, adapter_id: int) -> dict:
    with session_factory(cli.settings.database_url)() as session:
        return dict(BlobStore(cli.settings.blob_dir).get_factors(str(session.get(Adapter, adapter_id).factors_blob)))


def answers(engine: QueryEngine, cli: CLI, query: int, method: str) -> dict[int, tuple[str, float]]:
    with session_factory(cli.settings.database_url)() as session:
        found = engine.similar(session, "tiny", Query("q", query), MAX_K, method=method)
    return {r["adapter_id"]: (r["name"], r["score"]) for r in found["results"]}


def served_as_itself(engine: QueryEngine, cli: CLI, gone: int, new: int, methods: tuple[str, ...] = ("hybrid", "module", "dw")) -> None:
    """No method answers with the deleted adapter (d11); the new one (d12) is answered with its own name and its own
    factors' scores."""
    q = factors(cli, 1)
    exact = {"module": module_cosine_matrix([q], [factors(cli, new)])[0, 0], "dw": dw_cosine_matrix([q], [factors(cli, new)])[0, 0]}
    for method in methods:
        found = answers(engine, cli, 1, method)
        assert (gone == new or gone not in found) and "d11" not in [name for name, _ in found.values()], method
        assert found[new][0] == "d12", method
        if method in exact:
            assert found[new][1] == pytest.approx(exact[method], abs=1e-5), method
    with session_factory(cli.settings.database_url)() as session:
        state = engine.space(session, "tiny")
    assert state.modules is not None and new in state.modules.rows
    assert state.attributes.name_and_labels(new) == ("d12", {"task": "a"})
    if gone != new:
        assert gone not in state.modules.rows and state.attributes.name_and_labels(gone) == ("?", {})
        assert gone not in state.attributes.with_label("task", "b").tolist()


def test_a_deleted_id_is_never_reused_and_nothing_keyed_by_it_is_served(cli: CLI, pool: Path) -> None:
    ids = ingest(cli, pool, pool / "zoo")
    assert cli.json_lines("train", "--epochs", "1", "--members", "1")[0] == 0  # embeds, then trains W2T (hybrid)
    engine = QueryEngine(session_factory(cli.settings.database_url), BlobStore(cli.settings.blob_dir), cli.settings.data_dir)
    for method in ("hybrid", "module", "dw"):
        assert max(ids) in answers(engine, cli, 1, method)  # the running engine holds the highest id everywhere
    gone = max(ids)
    delete_adapter(session_factory(cli.settings.database_url), gone)
    (new,) = ingest(cli, pool, pool / "later" / "d12")
    assert new > gone  # never the deleted id, on SQLite too
    assert cli.json_lines("embed")[0] == 0
    served_as_itself(engine, cli, gone, new)  # the running engine caught up
    fresh = QueryEngine(session_factory(cli.settings.database_url), BlobStore(cli.settings.blob_dir), cli.settings.data_dir)
    served_as_itself(fresh, cli, gone, new)  # one loaded from the files `zoo embed` brought up to date
    store = load_file(str(module_store_path(cli.settings.data_dir, 1)))
    assert gone not in store["ids"].tolist() and new in store["ids"].tolist()
    rc, (report,) = cli.json_lines("check")
    assert rc == 0 and report["ok"], report

    # planted: the module store and the sketch index each hold the deleted id (the index at the right count)
    data = cli.settings.data_dir
    path = module_store_path(data, 1)
    tensors, store_meta = read_derived(path, "module store")
    store = {k: np.concatenate([v, v[:1]]) for k, v in tensors.items()}  # row 0 again, as the deleted id
    store["ids"][-1] = gone
    write_derived(path, store, store_meta)
    sketch_file = index_path(data, fresh.space(session_factory(cli.settings.database_url)(), "tiny").embedders["module_sketch"].id)
    index, meta = AdapterIndex.load(sketch_file)
    vector = index.vectors(np.array([new]))
    index.remove(np.array([new]))
    index.upsert(np.array([gone]), vector)
    index.save(sketch_file, meta)
    rc, (report,) = cli.json_lines("check")
    assert rc == 1 and not report["ok"]
    stale = [e for e in report["indexes"] if e.get("stale")]
    assert {("module_store" in e, "embedder_id" in e) for e in stale} == {(True, False), (False, True)}, report["indexes"]
    assert all("no longer in the database" in e["state"] and str(gone) in e["state"] for e in stale)
    rc, (repaired,) = cli.json_lines("check", "--repair")
    assert rc == 0 and repaired["ok"], repaired
    rc, (after,) = cli.json_lines("check")
    assert rc == 0 and after["ok"], after
    assert gone not in load_file(str(path))["ids"].tolist() and not AdapterIndex.load(sketch_file)[0].contains(gone)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_migration_0011_makes_sqlite_ids_grow_past_deleted_and_tombstoned_ones(db_url: str) -> None:
    def insert(conn, adapter_id: int | None = None) -> int:  # type: ignore[no-untyped-def]
        conn.exec_driver_sql(
            "INSERT INTO adapter (id, name, source_uri, base_model, format, canonical_hash, structure_hash, file_sha256, size_bytes,"
            " config, file_metadata, extra_tensors, notes) VALUES (?, 'a', '/a', 'b', 'peft', hex(randomblob(8)), 's', 'f', 1,"
            " '{}', '{}', '{}', '[]')",
            (adapter_id,),
        )
        return int(conn.exec_driver_sql("SELECT max(id) FROM adapter").scalar())

    downgrade(db_url, "0010")
    with make_engine(db_url).begin() as conn:
        assert [insert(conn) for _ in range(3)] == [1, 2, 3]
        conn.exec_driver_sql("DELETE FROM adapter WHERE id = 3")
        assert insert(conn) == 3  # before 0011: SQLite hands the deleted id out again
        conn.exec_driver_sql("INSERT INTO embedding_space (id, name, base_model, schema, version) VALUES (1, 'b', 'b', '{}', 9)")
        conn.exec_driver_sql("INSERT INTO deleted_adapter (adapter_id, space_id, version) VALUES (7, 1, 9)")  # an id deleted long ago
    upgrade(db_url)
    with make_engine(db_url).begin() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM adapter").scalar() == 3
        assert insert(conn) == 8  # past the tombstoned id
        conn.exec_driver_sql("DELETE FROM adapter WHERE id = 8")
        assert insert(conn) == 9
        conn.exec_driver_sql("INSERT INTO label (adapter_id, key, value, source) VALUES (1, 'k', 'v', 'given')")
        newest = conn.exec_driver_sql("SELECT max(id) FROM label").scalar()
        conn.exec_driver_sql("DELETE FROM label WHERE id = ?", (newest,))
        conn.exec_driver_sql("INSERT INTO label (adapter_id, key, value, source) VALUES (1, 'k', 'w', 'given')")
        assert conn.exec_driver_sql("SELECT max(id) FROM label").scalar() == newest + 1  # a replaced label gets a new id


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_an_id_reused_before_0011_is_served_with_the_new_adapters_name_and_factors(cli: CLI, pool: Path) -> None:
    """A database that reused ids before migration 0011 (the issue's reproduction: delete the highest id, ingest another,
    it gets the same id): the tombstone tells the engine and `zoo embed` to drop what they held for it."""
    ids = ingest(cli, pool, pool / "zoo")
    assert cli.json_lines("embed")[0] == 0
    engine = QueryEngine(session_factory(cli.settings.database_url), BlobStore(cli.settings.blob_dir), cli.settings.data_dir)
    gone = max(ids)
    assert answers(engine, cli, 1, "module")[gone][0] == "d11"
    delete_adapter(session_factory(cli.settings.database_url), gone)
    with make_engine(cli.settings.database_url).begin() as conn:  # as SQLite did before 0011
        conn.exec_driver_sql("UPDATE sqlite_sequence SET seq = ? WHERE name = 'adapter'", (gone - 1,))
    (new,) = ingest(cli, pool, pool / "later" / "d12")
    assert new == gone
    assert cli.json_lines("embed")[0] == 0
    served_as_itself(engine, cli, gone, new, ("module", "dw"))
    fresh = QueryEngine(session_factory(cli.settings.database_url), BlobStore(cli.settings.blob_dir), cli.settings.data_dir)
    served_as_itself(fresh, cli, gone, new, ("module", "dw"))
    rc, (report,) = cli.json_lines("check")
    assert rc == 0 and report["ok"], report
