"""`zoo check`: finds missing and corrupt blobs, orphans, temporary files, bad indexes and unembedded
adapters; `--repair` fixes what can be fixed and leaves young files alone."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from tests.conftest import CLI
from tests.factories import train_peft_adapter


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("check-zoo")
    for i in range(3):
        train_peft_adapter(root / f"c{i}", seed=500 + i, steps=2)
    return root


def test_check_finds_and_repairs(cli: CLI, three: Path, tmp_path: Path) -> None:
    for i in range(2):
        rc, _ = cli.json_lines("ingest", "--no-embed", str(three / f"c{i}"), "--base-model", "tiny")
    rc, _ = cli.json_lines("embed")
    rc, (report,) = cli.json_lines("check")
    assert rc == 0 and report["ok"] and report["blobs"]["rows"] == 2

    blobs = cli.settings.blob_dir
    some_blob = next(blobs.rglob("*.safetensors"))
    orphan = blobs / "ff" / ("f" * 64 + ".safetensors")
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"left by a transaction that never committed")
    stray = some_blob.parent / ".tmp-killed"
    stray.write_bytes(b"half a blob")
    index = next((cli.settings.data_dir / "index").glob("*.index"))
    index.write_bytes(index.read_bytes()[:100])  # truncated
    rc, _ = cli.json_lines("ingest", "--no-embed", str(three / "c2"), "--base-model", "tiny")  # ingested, not embedded

    rc, (young,) = cli.json_lines("check")  # the default grace: fresh files may belong to open transactions
    assert rc == 1 and young["in_flight"] == 2 and not young["orphans"]
    assert any(i["state"] != "ok" for i in young["indexes"]) and young["unembedded"][0]["count"] == 1
    rc, (found,) = cli.json_lines("check", "--grace", "0")
    assert rc == 1 and found["orphans"] == [str(orphan)] and found["temporary_files"] == [str(stray)]

    saved = tmp_path / "blob"
    shutil.move(some_blob, saved)  # a row's blob lost: reported, and not repairable
    rc, (lost,) = cli.json_lines("check", "--grace", "0")
    assert rc == 1 and len(lost["blobs"]["missing"]) == 1
    shutil.move(saved, some_blob)
    some_blob.write_bytes(some_blob.read_bytes()[:-1] + b"\0")  # and one corrupted
    rc, (bad,) = cli.json_lines("check", "--grace", "0")
    assert rc == 1 and len(bad["blobs"]["corrupt"]) == 1
    rc, out, err = cli("check", "--repair", "--grace", "0")
    assert rc == 1 and "missing or corrupt: ingest it again" in out
    assert not orphan.exists() and not stray.exists()

    rc, (after,) = cli.json_lines("check", "--grace", "0")
    assert after["orphans"] == [] and all(i["state"] == "ok" for i in after["indexes"]) and after["unembedded"] == []
    assert after["problems"] == 1  # only the corrupt blob is left


def test_check_finds_orphaned_uploads_and_stranded_items_and_repair_leaves_what_a_live_item_owns(cli: CLI) -> None:
    """A worker killed while it copied an upload, or mid-job, leaves the upload under uploads/ and its item
    `running`: before, `zoo check` said ok and `--repair` removed nothing. Now an upload folder no queued or running
    item owns, untouched for the grace period, is an orphan (removed on repair); an item whose lease ran out, or
    whose holder was a process of this host that has exited, is stranded (queued again on repair)."""
    import os
    import socket
    import subprocess
    import sys

    from zoo.store.job_resources import get_job
    from zoo.store.jobs import claim_items, create_job
    from zoo.store.session import session_factory

    uploads = cli.settings.data_dir / "uploads"
    folders = {name: uploads / name for name in ("a" * 32, "b" * 32, "c" * 32, "query-killed", "query-live")}
    for folder in folders.values():
        folder.mkdir(parents=True)
        (folder / "w.safetensors").write_bytes(b"an upload's bytes")
    sessions = session_factory(cli.settings.database_url)
    with sessions.begin() as session:
        owned = create_job(session, [str(folders["b" * 32] / "w.safetensors")], {"base_model": "tiny"}).id  # queued: owns b
        held = create_job(session, [str(folders["c" * 32] / "w.safetensors")], {"base_model": "tiny"}).id  # its worker exits
        lapsed = create_job(session, ["/elsewhere/x.safetensors"], {"base_model": "tiny"}).id  # its lease runs out
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    assert claim_items(sessions, f"{socket.gethostname()}:{exited}:zoo-job", 600, job_id=held)
    assert claim_items(sessions, "another-host:1:MainThread", -1, job_id=lapsed)
    assert claim_items(sessions, f"{socket.gethostname()}:{os.getpid()}:MainThread", 600, job_id=owned)  # alive: not stranded
    hour_ago = time.time() - 3600
    for name in ("a" * 32, "b" * 32, "c" * 32, "query-killed"):
        for path in (folders[name] / "w.safetensors", folders[name]):
            os.utime(path, (hour_ago, hour_ago))

    rc, (found,) = cli.json_lines("check", "--grace", "60")
    orphans = [str(folders["a" * 32]), str(folders["query-killed"])]  # b and c are owned by their items; query-live is young
    assert rc == 1 and found["uploads"] == {"orphans": orphans, "in_flight": 3, "removed": 0}, found["uploads"]
    stranded = {(i["job_id"], i["why"]) for i in found["jobs"]["stranded"]}
    assert stranded == {(held, "holder exited"), (lapsed, "lease expired")} and found["problems"] == 4

    rc, out, _ = cli("check", "--repair", "--grace", "60")
    assert "orphaned upload" in out and "queued again" in out
    assert not folders["a" * 32].exists() and not folders["query-killed"].exists()
    assert all(folders[name].exists() for name in ("b" * 32, "c" * 32, "query-live"))  # a requeued item keeps its upload
    with sessions() as session:
        assert [get_job(session, j)["items"][0]["state"] for j in (owned, held, lapsed)] == ["running", "queued", "queued"]
    rc, (after,) = cli.json_lines("check", "--grace", "60")
    assert rc == 0 and after["ok"] and after["uploads"]["orphans"] == [] and after["jobs"]["stranded"] == [], after


def test_a_worker_with_nothing_to_claim_takes_over_the_items_of_an_exited_holder(cli: CLI, three: Path) -> None:
    """A web worker killed mid-job leaves its item `running` under a lease of 10 minutes: before, a draining worker
    waited for the lease to run out; now it sees the holder has exited, queues the item again and ingests it."""
    import socket
    import subprocess
    import sys
    import threading

    from zoo.runners.worker import WorkerOptions, work
    from zoo.store.job_resources import get_job
    from zoo.store.jobs import claim_items, create_job
    from zoo.store.session import session_factory

    sessions = session_factory(cli.settings.database_url)
    with sessions.begin() as session:
        job = create_job(session, [str(three / "c0")], {"base_model": "tiny"}).id
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    assert claim_items(sessions, f"{socket.gethostname()}:{exited}:zoo-job", 600, job_id=job)
    outcomes: list[object] = []
    stop = threading.Event()
    drained = threading.Thread(target=lambda: outcomes.extend(work(cli.settings, WorkerOptions(job_id=job, drain=True), stop)))
    drained.start()
    drained.join(timeout=30)
    stop.set()
    with sessions() as session:
        item = get_job(session, job)["items"][0]
    assert not drained.is_alive() and item["state"] == "done", item
