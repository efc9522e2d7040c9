"""The one label write: the API's label write and ingest's of the same adapter take one lock on PostgreSQL.

A transaction holds the adapter's label lock (zoo.store.locks.label_lock) and nothing else (no row lock another writer
could wait for); meanwhile `PUT /api/v1/adapters/{id}/labels`, the ingest of a stored copy of the adapter's files and
the ingest of the same update in another factorization, each in a thread of its own, bring labels. Each waits until
the transaction ends, then writes its labels: so an API write and an ingest of one adapter are serialized, whichever
comes first (without it, each deletes the labels of its keys that it sees and inserts its own: both rows stay).
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
from sqlalchemy import select

from tests.conftest import truncate_all
from tests.factories import write_random_peft_adapters
from tests.test_ingest import refactorize
from webapp import create_app
from zoo.labels import LabelRow
from zoo.services.ingest import IngestOptions, Ingestor
from zoo.store import tokens
from zoo.store.blobs import BlobStore
from zoo.store.locks import label_lock
from zoo.store.models import AdapterText, Label
from zoo.store.session import make_engine, session_factory, write_transaction

pytestmark = pytest.mark.postgres
#: how long a writer is seen to wait for the lock before it is let go
WAIT_S = 0.4


@pytest.fixture
def stored(pg_url: str, tmp_path: Path) -> Iterator[tuple[str, Path, int]]:
    """(database URL, data dir, id) of one ingested adapter, its files at tmp_path/0000."""
    truncate_all(pg_url)
    (path,) = write_random_peft_adapters(tmp_path, 1)
    data_dir = tmp_path / "data"
    result = _ingestor(pg_url, data_dir).ingest(path)
    assert result.status == "ingested", result.error
    yield pg_url, data_dir, int(result.adapter_id)
    make_engine(pg_url).dispose()


def _ingestor(url: str, data_dir: Path) -> Ingestor:
    return Ingestor(session_factory(url), BlobStore(data_dir / "blobs"), IngestOptions(device="cpu"))


def _waits_for_held_labels(url: str, adapter_id: int, write: Callable[[], object], style: str) -> object:
    """Run `write` in a thread while this thread's transaction holds the adapter's label lock: it must still be running
    after WAIT_S (waiting for the lock, since the transaction holds no row lock), and finish once the transaction
    commits, its style written once, in the labels and the search document."""
    done: list[object] = []
    thread = threading.Thread(target=lambda: done.append(write()), daemon=True)
    with write_transaction(session_factory(url), label_lock(adapter_id)):  # the lock alone: no row it could wait for
        thread.start()
        thread.join(WAIT_S)
        assert thread.is_alive() and not done, "the label write did not wait for the adapter's label lock"
    thread.join(30)
    assert done, "the label write did not finish once the lock was released"
    with session_factory(url)() as s:
        styles = s.scalars(select(Label.value).where(Label.adapter_id == adapter_id, Label.key == "style")).all()
        document = s.scalar(select(AdapterText.document).where(AdapterText.adapter_id == adapter_id))
    assert styles == [style] and f"style {style}" in document
    return done[0]


def test_api_and_ingest_label_writes_of_one_adapter_wait_for_each_other(stored: tuple[str, Path, int], tmp_path: Path) -> None:
    url, data_dir, adapter_id = stored
    app = create_app({"ZOO_DATABASE_URL": url, "ZOO_DATA_DIR": str(data_dir), "TESTING": True})
    with session_factory(url).begin() as session:
        _, token = tokens.create_token(session, "labeller", "write")

    def api_write() -> object:
        body = {"labels": {"style": "api"}, "measurements": {}}
        return app.test_client().put(f"/api/v1/adapters/{adapter_id}/labels", json=body, headers={"Authorization": f"Bearer {token}"})

    assert _waits_for_held_labels(url, adapter_id, api_write, "api").status_code == 200

    # the same files elsewhere (a stored copy, recognized by its SHA-256), then the same update in other factors
    shutil.copytree(tmp_path / "0000", tmp_path / "copy")
    refactorize(tmp_path / "0000", tmp_path / "refactored", seed=1)
    for source, style in ((tmp_path / "copy", "copy"), (tmp_path / "refactored", "refactored")):
        ingest = partial(_ingestor(url, data_dir).ingest, source, labels=LabelRow({"style": style}, {}))
        result = _waits_for_held_labels(url, adapter_id, ingest, style)
        assert (result.status, result.adapter_id) == ("duplicate", adapter_id), result.error
