"""Fixtures: a database per test on SQLite always and on PostgreSQL when ZOO_TEST_DATABASE_URL is set."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from zoo.cli import main
from zoo.config import Settings, normalize_database_url
from zoo.store.session import downgrade, make_engine, upgrade

PG_URL = os.environ.get("ZOO_TEST_DATABASE_URL")


def _backends() -> list[object]:
    return ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


@pytest.fixture(scope="session")
def pg_url() -> str:
    """A migrated PostgreSQL database; a set but unreachable URL is an error, never a skip."""
    if not PG_URL:
        pytest.skip("ZOO_TEST_DATABASE_URL is not set")
    url = normalize_database_url(PG_URL)
    downgrade(url, "base")
    upgrade(url)
    return url


@pytest.fixture(params=_backends())
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'zoo.db'}"
        upgrade(url)
        yield url
        make_engine(url).dispose()
        return
    url = request.getfixturevalue("pg_url")
    truncate_all(url)
    yield url


def truncate_all(url: str) -> None:
    """Empty every table of a PostgreSQL test database."""
    with make_engine(url).begin() as conn:
        tables = "adapter, module, label, measurement, embedding_space, embedder, embedding, api_token, job, job_item, deleted_adapter"
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
