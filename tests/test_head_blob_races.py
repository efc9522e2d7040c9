"""A PEFT adapter's head blob (adapter.head_blob: a SEQ_CLS adapter's modules_to_save) under concurrent deletes and a
kill -9, on PostgreSQL with real processes where a process matters: an export of an adapter deleted while it is read
is whole (or a 404), never a 500 nor an export without its modules or head; an adapter sharing a head blob with one
deleted while it is ingested keeps that blob through `zoo check --repair`; an ingest killed after its blobs went under
their digests and before its rows committed leaves only orphans `zoo check --repair` removes, and running it again
adopts them."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, load_file, save_file
from sqlalchemy import select

from tests.conftest import truncate_all
from tests.test_attack_resources import _before_statement
from tests.test_export_loads import write_seq_cls_adapter
from webapp import create_app
from zoo.cli import main
from zoo.config import Settings
from zoo.services.check import check
from zoo.store.models import Adapter
from zoo.store.session import session_factory

pytestmark = [pytest.mark.postgres, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DistilBERT SEQ_CLS adapters saved by PEFT: a and b (heads of their own), and a_twin: a's head, other factors."""
    root = tmp_path_factory.mktemp("heads")
    write_seq_cls_adapter("distilbert", root / "a", seed=1)
    write_seq_cls_adapter("distilbert", root / "b", seed=2)
    shutil.copytree(root / "a", root / "a_twin")
    weights = root / "a_twin" / "adapter_model.safetensors"
    tensors = load_file(weights)
    save_file({k: t * 2 if "lora_B" in k else t for k, t in tensors.items()}, str(weights), metadata={"format": "pt"})
    return root


def _zoo(url: str, data: Path, *args: str) -> int:
    return main(["--db", url, "--data-dir", str(data), *args])


def _ids(url: str) -> dict[str, tuple[int, str | None, str | None]]:
    """Stored adapters by name: (id, factors blob, head blob)."""
    with session_factory(url)() as s:
        return {n: (i, f, h) for i, n, f, h in s.execute(select(Adapter.id, Adapter.name, Adapter.factors_blob, Adapter.head_blob))}


def _deleting(url: str, adapter_id: int) -> Callable[[], None]:
    """Delete the adapter (committed, in connections of its own)."""
    from embed.serving.adapter_resource import delete_adapter

    return lambda: delete_adapter(session_factory(url), adapter_id)


def _head_of(zip_bytes: bytes) -> dict[str, torch.Tensor]:
    with zipfile.ZipFile(io.BytesIO(zip_bytes)) as zf:
        (weights,) = [n for n in zf.namelist() if n.endswith(".safetensors")]
        tensors = load(zf.read(weights))
    return {k: t for k, t in tensors.items() if "lora_" not in k}


def test_an_adapter_deleted_while_its_export_reads_it_is_exported_whole_or_not_found(pg_url: str, heads: Path, tmp_path: Path) -> None:
    """Deleted (and committed) between the statement that reads the adapter's row and the one that reads its modules:
    the download answers the export it would have given before (one snapshot), `zoo export` too; what the delete left
    (its blobs) is what `zoo check --repair` removes, and a head another adapter shares stays."""
    truncate_all(pg_url)
    data = tmp_path / "data"
    assert _zoo(pg_url, data, "ingest", "--no-embed", str(heads / "a"), str(heads / "b"), "--json") == 0
    ids = _ids(pg_url)
    (a, _, a_head), (b, _, _) = ids["a"], ids["b"]
    assert a_head is not None
    client = create_app({"ZOO_DATABASE_URL": pg_url, "ZOO_DATA_DIR": str(data)}).test_client()
    whole = client.get(f"/api/v1/adapters/{a}/download?format=peft")
    assert whole.status_code == 200 and _head_of(whole.data)

    stop = _before_statement(pg_url, "FROM module", _deleting(pg_url, a))
    try:
        during = client.get(f"/api/v1/adapters/{a}/download?format=peft")
    finally:
        stop()
    assert during.status_code == 200 and during.data == whole.data
    assert client.get(f"/api/v1/adapters/{a}/download?format=peft").status_code == 404

    out = tmp_path / "b.zip"
    stop = _before_statement(pg_url, "FROM module", _deleting(pg_url, b))
    try:
        rc = _zoo(pg_url, data, "export", str(b), "--format", "peft", "--out", str(out))
    finally:
        stop()
    assert rc == 0 and _head_of(out.read_bytes()), rc
    assert "b" not in _ids(pg_url)

    report = check(Settings(data_dir=data, database_url=pg_url), grace_s=0)
    assert not report["blobs"]["missing"] and len(report["orphans"]) == 4  # a's and b's factors and heads
    assert check(Settings(data_dir=data, database_url=pg_url), repair=True, grace_s=0)["removed"] == 4
    assert check(Settings(data_dir=data, database_url=pg_url), grace_s=0)["ok"]


def test_a_head_blob_shared_with_an_adapter_deleted_during_the_ingest_stays(pg_url: str, heads: Path, tmp_path: Path) -> None:
    """a_twin (a's head, other factors) ingested while a is deleted, just before a_twin's row is inserted: a_twin's row
    refers to the head blob a left, `zoo check --repair` removes only a's factors, and a_twin's export has the head."""
    truncate_all(pg_url)
    data = tmp_path / "data"
    settings = Settings(data_dir=data, database_url=pg_url)
    assert _zoo(pg_url, data, "ingest", "--no-embed", str(heads / "a"), "--json") == 0
    a, a_factors, a_head = _ids(pg_url)["a"]
    stop = _before_statement(pg_url, "INSERT INTO adapter", _deleting(pg_url, a))
    try:
        assert _zoo(pg_url, data, "ingest", "--no-embed", str(heads / "a_twin"), "--json") == 0
    finally:
        stop()
    ids = _ids(pg_url)
    assert set(ids) == {"a_twin"} and ids["a_twin"][2] == a_head and ids["a_twin"][1] != a_factors
    repaired = check(settings, repair=True, grace_s=0)
    assert repaired["removed"] == 1 and not repaired["blobs"]["missing"] and check(settings, grace_s=0)["ok"]
    client = create_app({"ZOO_DATABASE_URL": pg_url, "ZOO_DATA_DIR": str(data)}).test_client()
    twin = client.get(f"/api/v1/adapters/{ids['a_twin'][0]}/download?format=peft")
    a_file = load_file(heads / "a" / "adapter_model.safetensors")
    assert twin.status_code == 200
    exported = _head_of(twin.data)
    assert exported.keys() == {k for k in a_file if "lora_" not in k} and all(torch.equal(t, a_file[k]) for k, t in exported.items())


#: `zoo ingest` in a process that kills itself (SIGKILL) when its write transaction is about to commit, once a blob
#: is under its digest in the store: after its blobs were renamed there and before its rows are committed
_KILLED_AT_COMMIT = """
import os, signal, sys
from pathlib import Path
from sqlalchemy import event
from sqlalchemy.engine import Engine
blobs = Path(sys.argv[2]) / "blobs"

def commit(conn):
    if any(p.suffix == ".safetensors" and not p.name.startswith(".") for p in blobs.rglob("*")):
        os.kill(os.getpid(), signal.SIGKILL)

event.listen(Engine, "commit", commit)
from zoo.cli import main
sys.exit(main(["--db", sys.argv[1], "--data-dir", sys.argv[2], "ingest", "--no-embed", sys.argv[3]]))
"""


@pytest.mark.slow
def test_an_ingest_killed_between_its_blobs_and_its_commit_leaves_what_check_repairs(pg_url: str, heads: Path, tmp_path: Path) -> None:
    """kill -9 after a SEQ_CLS adapter's factors and head went under their digests, before its rows committed: no row
    (so none without its blob), the two blobs are orphans `zoo check` names and `--repair` removes; or, once the same
    ingest runs again, blobs its row refers to (the store's copy, touched), and `zoo check` finds nothing orphaned."""
    truncate_all(pg_url)
    data = tmp_path / "data"
    settings = Settings(data_dir=data, database_url=pg_url)
    assert _zoo(pg_url, data, "init") == 0
    for rerun in (False, True):
        proc = subprocess.run(
            [sys.executable, "-c", _KILLED_AT_COMMIT, pg_url, str(data), str(heads / "b")], capture_output=True, text=True
        )
        assert proc.returncode == -9, proc.stderr[-2000:]
        assert _ids(pg_url) == {}
        report = check(settings, grace_s=0)
        assert not report["blobs"]["missing"] and len(report["orphans"]) == 2 and not report["ok"], report
        assert check(settings)["in_flight"] == 2  # young: maybe a transaction still open, never removed
        if not rerun:
            assert check(settings, repair=True, grace_s=0)["removed"] == 2
            assert check(settings, grace_s=0)["ok"]
            continue
        assert _zoo(pg_url, data, "ingest", "--no-embed", str(heads / "b"), "--json") == 0
        (_, factors, head) = _ids(pg_url)["b"]
        assert sorted(Path(p).stem for p in report["orphans"]) == sorted((factors, head))
        final = check(settings, grace_s=0)
        assert final["ok"] and not final["orphans"] and final["blobs"]["rows"] == 1, final
