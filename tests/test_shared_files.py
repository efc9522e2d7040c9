"""Folders beside the blobs (zoo/store/shared_files.py): with the data dir's blobs they stay where they are; with a
bucket (a real SeaweedFS) they go up with a manifest and come back into another node's data dir whole and checked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import truncate_all
from tests.seaweedfs import SeaweedFS
from zoo.config import Settings
from zoo.store.blob_backends import open_blob_store
from zoo.store.blobs import BlobStore
from zoo.store.session import session_factory
from zoo.store.shared_files import CorruptFile, in_bucket, local_folder, publish, unpublish
from zoo.store.space_adapters import factor_digests


def _folder(data_dir: Path) -> str:
    root = data_dir / "embedders" / "tiny-w2t"
    (root / "sub").mkdir(parents=True)
    (root / "weights.safetensors").write_bytes(bytes(range(256)) * 64)
    (root / "sub" / "meta.json").write_text('{"members": 1}')
    return "embedders/tiny-w2t"


def test_with_the_data_dirs_blobs_a_folder_stays_where_it_is(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "a" / "blobs")
    folder = _folder(tmp_path / "a")
    publish(blobs, tmp_path / "a", folder)
    assert not in_bucket(blobs) and not (tmp_path / "a" / "blobs").exists()
    assert local_folder(blobs, tmp_path / "a", folder) == tmp_path / "a" / folder
    assert local_folder(blobs, tmp_path / "b", folder) == tmp_path / "b" / folder and not (tmp_path / "b").exists()


@pytest.fixture
def bucket(seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[SeaweedFS, str]]:
    name = seaweedfs.new_bucket()
    for key, value in seaweedfs.env(name).items():
        monkeypatch.setenv(key, value)
    yield seaweedfs, name


def test_a_folder_goes_up_and_comes_back_whole_and_checked(bucket: tuple[SeaweedFS, str], tmp_path: Path) -> None:
    store, name = bucket
    blobs = open_blob_store(Settings.load(data_dir=tmp_path / "a"))
    folder = _folder(tmp_path / "a")
    assert in_bucket(blobs)
    with pytest.raises(FileNotFoundError):  # not published yet: no manifest
        local_folder(blobs, tmp_path / "b", folder)
    publish(blobs, tmp_path / "a", folder)
    got = local_folder(blobs, tmp_path / "b", folder)
    assert got == tmp_path / "b" / folder
    for relative in ("weights.safetensors", "sub/meta.json"):
        assert (got / relative).read_bytes() == (tmp_path / "a" / folder / relative).read_bytes()
    assert sorted(p.name for p in got.rglob("*")) == ["meta.json", "sub", "weights.safetensors"]  # no manifest left

    key = f"blobs/files/{folder}/weights.safetensors"
    store.client().put_object(Bucket=name, Key=key, Body=b"flipped at rest")
    with pytest.raises(CorruptFile, match="differs from its manifest"):
        local_folder(blobs, tmp_path / "c", folder)
    assert list((tmp_path / "c" / "embedders").iterdir()) == []  # nothing half-fetched left in place
    assert unpublish(blobs, folder) == 3  # two files and the manifest
    assert not store.client().list_objects_v2(Bucket=name, Prefix="blobs/files/").get("Contents")


@pytest.mark.postgres
def test_factor_digests_of_more_ids_than_a_statement_may_bind(pg_url: str) -> None:
    truncate_all(pg_url)
    with session_factory(pg_url)() as session:  # a new replica's module store reads 100k adapters' digests at once
        assert factor_digests(session, list(range(1, 70_001))) == {}
