"""Blobs in S3-compatible object storage (zoo/store/s3_blobs.py) against a real SeaweedFS (tests/seaweedfs.py): the
same interface and keys as the local store, verified reads, uploads in parts, nothing half-written visible, and what
`zoo check` finds and repairs in a bucket."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from tests.seaweedfs import SeaweedFS
from zoo.config import Settings
from zoo.store.blob_backends import open_blob_store
from zoo.store.blobs import BlobStore, StagingStopped
from zoo.store.s3_blobs import MIN_PART_BYTES, CorruptBlob, S3BlobStore


@pytest.fixture
def s3_env(seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[SeaweedFS, str]]:
    """A bucket of the test's own, and this process's environment pointing zoo at it."""
    bucket = seaweedfs.new_bucket()
    for name, value in seaweedfs.env(bucket).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ZOO_S3_PART_BYTES", str(MIN_PART_BYTES))
    yield seaweedfs, bucket


def _arrays(seed: int, rows: int = 64) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return {
        "m.U": g.standard_normal((rows, 8), dtype=np.float32),
        "m.S": g.random(8, dtype=np.float32),
        "m.V": g.standard_normal((32, 8), dtype=np.float32),
    }


def test_a_blob_goes_up_under_the_local_stores_key_and_comes_back_verified(s3_env: tuple[SeaweedFS, str], tmp_path) -> None:
    store, bucket = s3_env
    blobs = open_blob_store(Settings.load(data_dir=tmp_path))
    assert isinstance(blobs, S3BlobStore)
    local = BlobStore(tmp_path / "local")
    arrays = _arrays(0)
    staged = blobs.stage_arrays(arrays)
    blobs.commit(staged)
    here = local.stage_arrays(arrays)
    local.commit(here)
    assert staged.digest == here.digest and staged.size == here.size  # the same bytes, so the same digest
    key = f"blobs/{BlobStore.key(staged.digest)}"
    body = store.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    assert body == local.path(here.digest).read_bytes() and hashlib.sha256(body).hexdigest() == staged.digest
    got = blobs.get(staged.digest)
    assert all(torch.equal(got[k], torch.from_numpy(v)) for k, v in arrays.items())
    assert blobs.verify(staged.digest) == "ok" and blobs.verify("0" * 64) == "missing"
    head = blobs.stage_tensors({"head.weight": torch.arange(6, dtype=torch.int64)})
    assert torch.equal(blobs.get(head.digest)["head.weight"], torch.arange(6))


def test_a_corrupt_object_is_refused_on_read_naming_its_key(s3_env: tuple[SeaweedFS, str], tmp_path) -> None:
    store, bucket = s3_env
    blobs = open_blob_store(Settings.load(data_dir=tmp_path))
    staged = blobs.stage_arrays(_arrays(1))
    key = f"blobs/{BlobStore.key(staged.digest)}"
    body = bytearray(store.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF  # one bit of a factor flipped at rest
    store.client().put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with pytest.raises(CorruptBlob, match=f"s3://{bucket}/{key} is corrupt"):
        blobs.get_factors(staged.digest)
    assert blobs.verify(staged.digest) == "corrupt"


def test_a_large_blob_goes_up_in_parts_and_a_stopped_upload_leaves_nothing_visible(s3_env: tuple[SeaweedFS, str], tmp_path) -> None:
    store, bucket = s3_env
    blobs = open_blob_store(Settings.load(data_dir=tmp_path))
    big = _arrays(2, rows=(3 * MIN_PART_BYTES) // 32)  # three parts and some
    staged = blobs.stage_arrays(big)
    info = store.client().head_object(Bucket=bucket, Key=f"blobs/{BlobStore.key(staged.digest)}")
    assert info["ContentLength"] == staged.size > 3 * MIN_PART_BYTES
    assert "-" in info["ETag"]  # a multipart upload's ETag: <md5 of the parts' md5s>-<parts>
    assert torch.equal(blobs.get(staged.digest)["m.U"], torch.from_numpy(big["m.U"]))

    stop, seen = threading.Event(), []
    other = _arrays(3, rows=(3 * MIN_PART_BYTES) // 32)

    def hashed(digest: str) -> None:
        seen.append(digest)
        stop.set()  # a duplicate: the writer is discarded as soon as its digest is known

    with pytest.raises(StagingStopped):
        blobs.stage_arrays(other, hashed=hashed, stop=stop)
    assert blobs.verify(seen[0]) == "missing"
    leftovers = blobs.leftovers({staged.digest}, time.time(), grace_s=0)
    assert leftovers.orphans == [] and leftovers.temporary == []


def test_orphans_and_unfinished_uploads_are_found_and_removed(s3_env: tuple[SeaweedFS, str], tmp_path) -> None:
    store, bucket = s3_env
    blobs = open_blob_store(Settings.load(data_dir=tmp_path))
    kept, orphan = blobs.stage_arrays(_arrays(4)), blobs.stage_arrays(_arrays(5))
    client = store.client()
    key = f"blobs/{BlobStore.key('ab' * 32)}"
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * MIN_PART_BYTES)
    client.put_object(Bucket=bucket, Key="blobs/notes.txt", Body=b"not a blob")  # not named like one: left alone

    young = blobs.leftovers({kept.digest}, time.time(), grace_s=3600)
    assert young.orphans == [] and young.temporary == [] and young.in_flight == 2
    found = blobs.leftovers({kept.digest}, time.time(), grace_s=0)
    assert found.orphans == [blobs.where(orphan.digest)]
    assert found.temporary == [f"s3://{bucket}/{key}?uploadId={upload}"]
    assert blobs.remove(found.orphans + found.temporary) == 2
    after = blobs.leftovers({kept.digest}, time.time(), grace_s=0)
    assert after.orphans == [] and after.temporary == [] and after.in_flight == 0
    assert blobs.verify(kept.digest) == "ok" and blobs.verify(orphan.digest) == "missing"
    assert client.get_object(Bucket=bucket, Key="blobs/notes.txt")["Body"].read() == b"not a blob"
