"""`zoo backup` and `zoo restore`: the seeded zoo (ingested, embedded, W2T trained) backed up, wiped (a new database and
a new data dir), restored, checked clean by `zoo check`, and searched with the same results, from SQLite into SQLite
and into PostgreSQL; a backup refused where it would overwrite, a restore refused into a zoo that holds one, and a
corrupt blob in a backup found before any row is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import copy_seeded, database_beside
from tests.seaweedfs import SeaweedFS
from zoo.cli import main
from zoo.store.backup import is_empty
from zoo.store.session import make_engine

METHODS = ("module", "w2t", "hybrid")


def zoo(url: str, data_dir: Path, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict | None, str]:
    """`zoo` run in this process; (exit code, its --json output if any, stderr)."""
    capsys.readouterr()
    rc = main(["--db", url, "--data-dir", str(data_dir), *args])
    out = capsys.readouterr()
    return rc, json.loads(out.out) if out.out.strip().startswith("{") else None, out.err


def searches(url: str, data_dir: Path, capsys: pytest.CaptureFixture[str], ids: list[int]) -> list[object]:
    found = []
    for adapter_id in ids:
        for method in METHODS:
            rc, result, err = zoo(url, data_dir, capsys, "search", str(adapter_id), "-k", "5", "--method", method, "--json")
            assert rc == 0, err
            found.append(result)
    return found


@pytest.mark.slow  # the seeded zoo copied, backed up, restored and its files rebuilt, searched 18 times each side
@pytest.mark.parametrize("target", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_backup_wipe_restore_gives_a_clean_check_and_the_same_searches(
    request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    source = copy_seeded(request, "sqlite", tmp_path / "source")
    with make_engine(source.url).connect() as conn:
        ids = [int(i) for i in conn.exec_driver_sql("SELECT id FROM adapter ORDER BY id LIMIT 2").scalars()]
    before = searches(source.url, source.data_dir, capsys, ids)

    rc, report, err = zoo(source.url, source.data_dir, capsys, "backup", str(tmp_path / "backup"), "--json")
    assert rc == 0, err
    assert report is not None and report["rows"]["adapter"] == 12 and report["blobs"] >= 12 and report["files"] >= 1
    rc, _, err = zoo(source.url, source.data_dir, capsys, "backup", str(tmp_path / "backup"), "--json")
    assert rc != 0 and "not an empty directory" in err  # never written over

    data_dir = tmp_path / "restored-data"
    if target == "sqlite":
        restored = run_restore(f"sqlite:///{tmp_path / 'restored.db'}", data_dir, tmp_path / "backup", capsys)
        after = searches(restored, data_dir, capsys, ids)
    else:
        with database_beside(request.getfixturevalue("pg_url"), "restore") as url:  # a new database, `zoo init`ed
            restored = run_restore(url, data_dir, tmp_path / "backup", capsys)
            after = searches(restored, data_dir, capsys, ids)
            make_engine(url).dispose()
    assert after == before


def run_restore(url: str, data_dir: Path, backup: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Restore into `url` and `data_dir`, check it, and try once more (refused: it holds a zoo now)."""
    rc, report, err = zoo(url, data_dir, capsys, "restore", str(backup), "--json")
    assert rc == 0, err
    assert report is not None and report["rows"]["adapter"] == 12 and report["rebuilt"]
    assert not any((data_dir / "blobs").rglob(".tmp-*"))
    rc, check, err = zoo(url, data_dir, capsys, "check", "--json")
    assert rc == 0 and check is not None and check["ok"], (check, err)
    rc, _, err = zoo(url, data_dir, capsys, "restore", str(backup), "--json")
    assert rc != 0 and "already holds a zoo" in err
    return url


@pytest.mark.slow  # as above, with a bucket of SeaweedFS's
def test_a_backup_restores_into_a_fresh_bucket_and_backs_up_from_it_again(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    seaweedfs: SeaweedFS,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = copy_seeded(request, "sqlite", tmp_path / "source")
    with make_engine(source.url).connect() as conn:
        ids = [int(i) for i in conn.exec_driver_sql("SELECT id FROM adapter ORDER BY id LIMIT 2").scalars()]
    before = searches(source.url, source.data_dir, capsys, ids)
    rc, first, err = zoo(source.url, source.data_dir, capsys, "backup", str(tmp_path / "backup"), "--json")
    assert rc == 0, err
    for name, value in seaweedfs.env(seaweedfs.new_bucket()).items():  # blobs in a new bucket from here on
        monkeypatch.setenv(name, value)
    data_dir = tmp_path / "restored-data"
    url = run_restore(f"sqlite:///{tmp_path / 'restored.db'}", data_dir, tmp_path / "backup", capsys)
    assert not (data_dir / "blobs").exists()  # in the bucket
    assert searches(url, data_dir, capsys, ids) == before
    rc, again, err = zoo(url, data_dir, capsys, "backup", str(tmp_path / "again"), "--json")
    assert rc == 0, err
    assert first is not None and again is not None and (again["blobs"], again["blob_bytes"]) == (first["blobs"], first["blob_bytes"])
    have = json.loads((tmp_path / "backup" / "manifest.json").read_text())["blobs"]
    assert json.loads((tmp_path / "again" / "manifest.json").read_text())["blobs"] == have
    for blob in have:
        assert (tmp_path / "again" / blob["file"]).read_bytes() == (tmp_path / "backup" / blob["file"]).read_bytes()


def test_a_corrupt_blob_in_a_backup_is_found_before_any_row_is_written(
    request: pytest.FixtureRequest, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = copy_seeded(request, "sqlite", tmp_path / "source")
    rc, report, err = zoo(source.url, source.data_dir, capsys, "backup", str(tmp_path / "backup"), "--json")
    assert rc == 0, err
    manifest = json.loads((tmp_path / "backup" / "manifest.json").read_text())
    blob = tmp_path / "backup" / manifest["blobs"][3]["file"]
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    url = f"sqlite:///{tmp_path / 'restored.db'}"
    rc, _, err = zoo(url, tmp_path / "restored-data", capsys, "restore", str(tmp_path / "backup"), "--json")
    assert rc != 0 and "is corrupt" in err and manifest["blobs"][3]["digest"] in err
    assert is_empty(url) and not any((tmp_path / "restored-data").rglob(".tmp-*"))
    (tmp_path / "backup" / "manifest.json").unlink()
    rc, _, err = zoo(url, tmp_path / "restored-data", capsys, "restore", str(tmp_path / "backup"))
    assert rc != 0 and "holds no manifest.json" in err
