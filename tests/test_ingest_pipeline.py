"""`zoo ingest`'s two sources at a time (zoo.services.ingest.ingest_sources: the next source read, canonicalized and
described while the one before is stored): the results in the sources' order, the stores too (ids rising, a copy
of an earlier source its duplicate, however close behind it comes), failures in their place, and every row's blob
in place, with blobs in the data dir (both databases) and in a bucket (a real SeaweedFS)."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.factories import write_random_peft_adapters
from tests.seaweedfs import SeaweedFS
from zoo.config import Settings
from zoo.services.check import check
from zoo.services.ingest import Ingestor, ingest_sources
from zoo.store.blob_backends import open_blob_store
from zoo.store.session import session_factory, upgrade


def _queue(root: Path) -> list[tuple[str, None]]:
    """Seven sources: five adapters, a copy of the first right behind it and of the third two later, and a broken file."""
    a, b, c, d, e = write_random_peft_adapters(root / "src", 5)
    shutil.copytree(a, root / "copy-of-a")
    shutil.copytree(c, root / "copy-of-c")
    (root / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    order = [a, root / "copy-of-a", b, c, root / "broken.safetensors", d, root / "copy-of-c", e]
    return [(str(p), None) for p in order]


def _ingest_all(settings: Settings, root: Path) -> None:
    upgrade(settings.database_url)
    blobs = open_blob_store(settings)
    queue = _queue(root)
    results = list(ingest_sources(Ingestor(session_factory(settings.database_url), blobs), queue))
    assert [r.source for r in results] == [s for s, _ in queue]
    assert [r.status for r in results] == ["ingested", "duplicate", "ingested", "ingested", "failed", "ingested", "duplicate", "ingested"]
    stored = [r.adapter_id for r in results if r.status == "ingested"]
    assert stored == sorted(stored) and len(set(stored)) == 5  # stored in the sources' order
    assert results[1].adapter_id == results[0].adapter_id and results[6].adapter_id == results[3].adapter_id
    assert "broken.safetensors" in (results[4].error or "")
    report = check(settings)
    assert report["ok"] and report["blobs"]["rows"] == 5 and not report["blobs"]["missing"], report


def test_two_at_a_time_store_in_order_with_blobs_in_the_data_dir(settings: Settings, tmp_path: Path) -> None:
    _ingest_all(settings, tmp_path)
    assert len(list((settings.data_dir / "blobs").rglob("*.safetensors"))) == 5


@pytest.mark.slow
def test_two_at_a_time_store_in_order_with_blobs_in_a_bucket(seaweedfs: SeaweedFS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in seaweedfs.env(seaweedfs.new_bucket()).items():
        monkeypatch.setenv(name, value)
    settings = Settings.load(f"sqlite:///{tmp_path / 'zoo.db'}", tmp_path / "data")
    assert settings.blob_url.startswith("s3://")
    _ingest_all(settings, tmp_path)
    assert not (settings.data_dir / "blobs").exists()


@pytest.mark.slow
def test_several_blobs_go_up_at_once_while_the_stores_wait_in_order(
    seaweedfs: SeaweedFS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the object store not answering (SIGSTOP), the next sources are still worked on, each one's blob going up on
    its own thread, until ZOO_S3_UPLOADS are in flight; once it answers, every source is stored, in order."""
    for name, value in seaweedfs.env(seaweedfs.new_bucket()).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ZOO_S3_UPLOADS", "3")  # three sources in flight
    settings = Settings.load(f"sqlite:///{tmp_path / 'zoo.db'}", tmp_path / "data")
    upgrade(settings.database_url)
    sources = [(str(p), None) for p in write_random_peft_adapters(tmp_path / "src", 6, seed=3)]
    ingestor = Ingestor(session_factory(settings.database_url), open_blob_store(settings))
    results: list = []

    def uploading() -> int:
        return sum(t.name == "zoo-blob-writer" and t.is_alive() for t in threading.enumerate())

    worker = threading.Thread(target=lambda: results.extend(ingest_sources(ingestor, sources)))
    seaweedfs.process.send_signal(signal.SIGSTOP)
    try:
        worker.start()
        deadline, most = time.monotonic() + 15, 0
        while most < 3 and time.monotonic() < deadline:
            most = max(most, uploading())
            time.sleep(0.01)
        time.sleep(0.3)
        assert not results  # nothing stored while no blob is up
        assert most == 3 and uploading() == 3, most  # the first three sources' blobs at once (no fourth begun)
    finally:
        seaweedfs.process.send_signal(signal.SIGCONT)
        worker.join(timeout=60)
    assert [r.status for r in results] == ["ingested"] * 6, [r.error for r in results]
    assert [r.adapter_id for r in results] == sorted(r.adapter_id for r in results)  # stored in the sources' order
    assert check(settings)["ok"]
