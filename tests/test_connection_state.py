"""Connection state under concurrency: intermittent 500s on PostgreSQL after a delete and an
ingest under 12 clients (`ResourceClosedError` in load_embeddings via the engine's catch-up, "can't change
'autocommit' now: connection in transaction status INTRANS" at pool checkout).

The cause: `zoo serve` checks the schema in gunicorn's master, whose pooled connection every forked worker
inherited (make_engine is cached per URL), so two processes spoke over one socket. A forked child now starts with
empty pools (zoo/store/session.py). Separately, a catch-up read under READ COMMITTED could see an embedding whose
adapter a concurrent delete had just removed (a KeyError, a 500): the engine now loads and catches up from one
snapshot (embed/serving/engine.py)."""

from __future__ import annotations

import multiprocessing
import random
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import func, select, text

from embed.serving import module_store
from embed.serving.adapter_resource import delete_adapter
from embed.serving.embedding_resource import embed_adapters
from embed.serving.engine import QueryEngine
from embed.serving.refs import StoredId
from embed.serving.resources import search
from embed.serving.results import Query
from tests.conftest import CLI
from tests.factories import write_random_peft_adapters
from zoo.services.ingest import IngestOptions, Ingestor
from zoo.store.blobs import BlobStore
from zoo.store.models import Adapter
from zoo.store.session import make_engine, require_schema, session_factory

POSTGRES_ONLY = pytest.mark.parametrize("db_url", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[Path]]:
    """12 adapters to seed a zoo with, and 16 more to ingest (and delete) while it serves."""
    root = tmp_path_factory.mktemp("connection-state")
    return write_random_peft_adapters(root / "seed", 12, seed=71), write_random_peft_adapters(root / "churn", 16, seed=72)


def seeded(cli: CLI, seed: list[Path]) -> None:
    rc, results = cli.json_lines("ingest", *map(str, seed), "--base-model", "tiny")  # and embedded
    assert rc == 0 and len(results) == len(seed)


def _child(url: str, seconds: float, out: multiprocessing.Queue) -> None:
    """A forked worker: 4 threads reading as requests do; reports the server backends it used and its errors."""
    sessions = session_factory(url)
    errors: Counter[str] = Counter()
    backends: set[int] = set()
    stop = time.monotonic() + seconds

    def run() -> None:
        while time.monotonic() < stop:
            try:
                with sessions() as session:
                    backends.add(int(session.execute(text("SELECT pg_backend_pid()")).scalar_one()))
                    session.execute(select(Adapter.id, Adapter.name).order_by(Adapter.id)).all()
            except Exception as exc:  # noqa: BLE001 - every error is the finding
                errors[f"{type(exc).__name__}: {str(exc)[:200]}"] += 1

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((sorted(backends), dict(errors)))


@POSTGRES_ONLY
def test_forked_workers_never_share_their_parents_pooled_connection(db_url: str) -> None:
    """As under `zoo serve`: the parent touches the database (gunicorn's master checks the schema), then forks
    workers that serve at once. Before the fix each child's first checkout took the parent's pooled connection:
    both children and the parent spoke over one socket (INTRANS at checkout, replies read by the wrong process)."""
    make_engine(db_url).dispose()  # one connection in the parent's pool, checked in when it forks
    require_schema(db_url)
    with make_engine(db_url).connect() as conn:
        parent_backend = int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue = ctx.Queue()
    children = [ctx.Process(target=_child, args=(db_url, 1.5, out)) for _ in range(2)]
    for p in children:
        p.start()
    with make_engine(db_url).connect() as conn:  # the parent goes on using its connection meanwhile
        stop = time.monotonic() + 1.5
        while time.monotonic() < stop:
            assert int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one()) == parent_backend
            conn.rollback()
    reports = [out.get(timeout=30) for _ in children]
    for p in children:
        p.join(timeout=30)
        assert p.exitcode == 0
    for backends, errors in reports:
        assert errors == {} and backends and parent_backend not in backends, (parent_backend, reports)


@POSTGRES_ONLY
def test_twelve_threads_delete_ingest_and_query_at_once(cli: CLI, adapters: tuple[list[Path], list[Path]]) -> None:
    """8 threads query (module, dw, sketch) through one engine, as the web app's request threads do, while 2 ingest,
    embed and delete new adapters (each delete and embed moves the space's version: the engine catches up under
    load) and 2 ingest stored ones again (duplicates). Nothing fails."""
    seed, churn = adapters
    seeded(cli, seed)
    url, data = cli.settings.database_url, cli.settings.data_dir
    sessions, blobs = session_factory(url), BlobStore(cli.settings.blob_dir)
    engine = QueryEngine(sessions, blobs, data)
    errors: Counter[str] = Counter()
    done: Counter[str] = Counter()
    stop = time.monotonic() + 4.0

    def guarded(kind: str, step) -> None:  # type: ignore[no-untyped-def]
        rng = random.Random(kind)
        while time.monotonic() < stop:
            try:
                step(rng)
                done[kind] += 1
            except Exception as exc:  # noqa: BLE001 - every error is the finding
                errors[f"{kind}: {type(exc).__name__}: {str(exc)[:200]}"] += 1

    def query(rng: random.Random) -> None:
        with sessions() as session:  # the seeded adapters (1-12) are never deleted
            search(engine, session, StoredId(rng.randint(1, 12)), 5, None, {}, rng.choice(("module", "dw", "sketch")))

    def churner(offset: int):  # type: ignore[no-untyped-def]
        ingestor, turn = Ingestor(sessions, blobs, IngestOptions(base_model="tiny")), [offset]

        def step(_rng: random.Random) -> None:
            result = ingestor.ingest(churn[turn[0] % len(churn)])
            turn[0] += 2
            if result.adapter_id is not None:
                embed_adapters(sessions, blobs, data, [result.adapter_id])
                delete_adapter(sessions, result.adapter_id)

        return step

    def duplicate(rng: random.Random) -> None:
        assert Ingestor(sessions, blobs, IngestOptions(base_model="tiny")).ingest(seed[rng.randrange(len(seed))]).status == "duplicate"

    jobs = [("query", query)] * 8 + [("churn-0", churner(0)), ("churn-1", churner(1))] + [("duplicate", duplicate)] * 2
    threads = [threading.Thread(target=guarded, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == {}, errors
    assert done["query"] > 20 and done["churn-0"] + done["churn-1"] > 2 and done["duplicate"] > 2, done
    with sessions() as session:
        assert session.scalar(select(func.count()).select_from(Adapter)) == 12
        found = engine.similar(session, "tiny", Query("q", 1), 50, method="module")
    assert sorted(r["adapter_id"] for r in found["results"]) == list(range(2, 13))  # the churned ones all gone


def test_a_catch_up_reads_one_snapshot(cli: CLI, adapters: tuple[list[Path], list[Path]], monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter deleted while the engine catches up, between reading its embedding and its factors' digest: the
    catch-up still sees it (one snapshot; under READ COMMITTED it failed with a KeyError, a 500), and the next
    request drops it (its tombstone)."""
    seed, churn = adapters
    seeded(cli, seed)
    url = cli.settings.database_url
    sessions = session_factory(url)
    engine = QueryEngine(sessions, BlobStore(cli.settings.blob_dir), cli.settings.data_dir)
    with sessions() as session:
        engine.similar(session, "tiny", Query("q", 1), 5, method="module")
    rc, (result,) = cli.json_lines("ingest", str(churn[0]), "--base-model", "tiny")  # and embedded
    assert rc == 0
    new = result["adapter_id"]
    factors_of = module_store.factors_of

    def deleted_meanwhile(session, blobs, ids):  # type: ignore[no-untyped-def]
        if new in ids and not deleted_meanwhile.done:  # type: ignore[attr-defined]
            deleted_meanwhile.done = True  # type: ignore[attr-defined]
            delete_adapter(sessions, new)  # another request's delete, committed now
        return factors_of(session, blobs, ids)

    deleted_meanwhile.done = False  # type: ignore[attr-defined]
    monkeypatch.setattr(module_store, "factors_of", deleted_meanwhile)
    with sessions() as session:
        engine.similar(session, "tiny", Query("q", 1), 20, method="module")
    assert deleted_meanwhile.done  # type: ignore[attr-defined]
    with sessions() as session:
        found = engine.similar(session, "tiny", Query("q", 1), 20, method="module")
    assert new not in [r["adapter_id"] for r in found["results"]] and len(found["results"]) == 11
