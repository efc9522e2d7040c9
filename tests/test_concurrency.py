"""Several real processes against one database: concurrent ingest and embed lose nothing and store
each update once; processes killed at random points leave at most what `zoo check --repair` removes."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from tests.factories import train_peft_adapter
from tests.test_ingest import refactorize
from zoo.config import Settings
from zoo.services.check import check
from zoo.store.models import Adapter, Embedder, Embedding, Label
from zoo.store.session import session_factory


def zoo_process(settings: Settings, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "zoo.cli", "--db", settings.database_url, "--data-dir", str(settings.data_dir), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def counts(settings: Settings) -> dict[str, Any]:
    with session_factory(settings.database_url)() as s:
        return {
            "adapters": int(s.scalar(select(func.count(Adapter.id))) or 0),
            "labelled": int(s.scalar(select(func.count(func.distinct(Label.adapter_id)))) or 0),
            "embeddings": int(s.scalar(select(func.count(Embedding.id))) or 0),
            # every active embedder's count of vectors: each must hold every adapter once
            "per_embedder": sorted(
                int(n)
                for n in s.scalars(
                    select(func.count(Embedding.id))
                    .join(Embedder, Embedder.id == Embedding.embedder_id)
                    .where(Embedder.active.is_(True))
                    .group_by(Embedder.id)
                )
            ),
            "active_sketch": int(
                s.scalar(select(func.count(Embedder.id)).where(Embedder.active.is_(True), Embedder.method == "module_sketch"))
            ),
        }


@pytest.fixture(scope="module")
def fifty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """25 real PEFT adapters and a re-factorized copy of each (the same 25 updates), labelled."""
    root = tmp_path_factory.mktemp("fifty")
    rows = ["name,task"]
    for i in range(25):
        train_peft_adapter(root / f"a{i:02d}", seed=300 + i, steps=2)
        refactorize(root / f"a{i:02d}", root / f"copy{i:02d}", seed=i)
        rows += [f"a{i:02d},t{i % 5}", f"copy{i:02d},t{i % 5}"]
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root


@pytest.mark.slow
@pytest.mark.postgres
def test_four_processes_ingest_and_three_embed_the_same_zoo_at_once(pg_url: str, tmp_path: Path, fifty: Path) -> None:
    from tests.conftest import truncate_all

    truncate_all(pg_url)
    settings = Settings(data_dir=tmp_path / "data", database_url=pg_url)
    ingest = ("ingest", "--no-embed", str(fifty), "--labels", str(fifty / "labels.csv"), "--base-model", "tiny", "--json")
    procs = [zoo_process(settings, *ingest) for _ in range(4)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [o[1][-2000:] for o in outs]
    statuses = [line.split('"status": "')[1].split('"')[0] for out, _ in outs for line in out.splitlines()]
    assert statuses.count("ingested") == 25 and statuses.count("duplicate") == 175 and "failed" not in statuses
    assert counts(settings)["adapters"] == 25 and counts(settings)["labelled"] == 25  # each update once, all labelled
    procs = [zoo_process(settings, "embed", "--json") for _ in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-2000:] for o in outs]
    c = counts(settings)
    assert c["per_embedder"] == [25] * len(c["per_embedder"]) and c["embeddings"] == 25 * len(c["per_embedder"]) >= 50
    assert c["active_sketch"] == 1
    report = check(settings, grace_s=0)
    assert report["ok"], report


@pytest.mark.slow
def test_processes_killed_at_random_points_leave_nothing_check_cannot_repair(db_url: str, tmp_path: Path, fifty: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", database_url=db_url)
    batch = tmp_path / "batch"
    batch.mkdir()
    for i in range(0, 25, 2):  # 13 adapters and their copies
        for name in (f"a{i:02d}", f"copy{i:02d}"):
            (batch / name).symlink_to(fifty / name)
    ingest = ("ingest", str(batch), "--labels", str(fifty / "labels.csv"), "--base-model", "tiny")  # killed storing or embedding
    rng = random.Random(0)
    kills = rounds = 0
    while kills < 10 and rounds < 40:  # 10 processes killed mid-run (ingesting or embedding)
        proc = zoo_process(settings, *(ingest if rounds % 3 else ("embed",)))
        rounds += 1
        time.sleep(rng.uniform(0.8, 3.0))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.communicate(timeout=120)
        report = check(settings, grace_s=0)
        blobs = report["blobs"]
        assert not blobs["missing"] and not blobs["corrupt"], report  # no committed row ever points at a missing blob
        with session_factory(settings.database_url)() as s:
            assert s.scalar(select(func.count(Adapter.id)).where(Adapter.factors_blob.is_(None))) == 0
    assert kills == 10
    repaired = check(settings, repair=True, grace_s=0)
    assert not repaired["blobs"]["missing"] and not repaired["blobs"]["corrupt"]
    assert check(settings, grace_s=0)["ok"]
    for args in (ingest, ("embed",)):  # re-running the batch completes it
        proc = zoo_process(settings, *args)
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-2000:]
    c = counts(settings)
    assert c["adapters"] == 13 and c["labelled"] == 13
    assert c["per_embedder"] == [13] * len(c["per_embedder"]) and c["embeddings"] == 13 * len(c["per_embedder"]) >= 26
    final = check(settings, grace_s=0)
    assert final["ok"], final
