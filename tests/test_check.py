"""`zoo check`: finds missing and corrupt blobs, orphans, temporary files, bad indexes and unembedded
adapters; `--repair` fixes what can be fixed and leaves young files alone."""

from __future__ import annotations

import shutil
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
        rc, _ = cli.json_lines("ingest", str(three / f"c{i}"), "--base-model", "tiny")
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
    rc, _ = cli.json_lines("ingest", str(three / "c2"), "--base-model", "tiny")  # ingested, not embedded

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
