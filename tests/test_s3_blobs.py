"""Blobs in S3-compatible object storage (zoo/store/s3_blobs.py) against a real SeaweedFS (tests/seaweedfs.py): the
same interface and keys as the local store, verified reads, uploads in parts, nothing half-written visible, and what
`zoo check` finds and repairs in a bucket."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import truncate_all
from tests.factories import write_random_peft_adapters
from tests.seaweedfs import SeaweedFS
from zoo.cli import main
from zoo.config import Settings
from zoo.errors import StorageError
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
    monkeypatch.setenv("ZOO_S3_MULTIPART_BYTES", str(MIN_PART_BYTES))  # a blob of a few parts goes up in parts
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


def test_a_blob_goes_up_in_one_put_the_store_checks_against_its_digest(s3_env: tuple[SeaweedFS, str], tmp_path, monkeypatch) -> None:
    """Below ZOO_S3_MULTIPART_BYTES a blob is one PUT carrying its SHA-256: bytes that changed after they were hashed
    (here: by the caller, in the arrays' memory, which is uploaded without a copy) are refused by the store, and no
    object appears under the digest."""
    store, bucket = s3_env
    monkeypatch.setenv("ZOO_S3_MULTIPART_BYTES", str(64 << 20))
    blobs = open_blob_store(Settings.load(data_dir=tmp_path))
    big = _arrays(6, rows=(3 * MIN_PART_BYTES) // 32)  # three parts' worth, in one request
    staged = blobs.stage_arrays(big)
    info = store.client().head_object(Bucket=bucket, Key=f"blobs/{BlobStore.key(staged.digest)}", ChecksumMode="ENABLED")
    assert "-" not in info["ETag"] and info["ContentLength"] == staged.size
    assert blobs.verify(staged.digest) == "ok"

    changed = _arrays(7)
    seen: list[str] = []

    def hashed(digest: str) -> None:
        seen.append(digest)
        changed["m.U"][0, 0] += 1.0  # after hashing, before the upload

    with pytest.raises(StorageError, match="BadDigest"):
        blobs.stage_arrays(changed, hashed=hashed)
    assert blobs.verify(seen[0]) == "missing"


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


# --- nodes that share only PostgreSQL and the bucket ------------------------------------------------------------------


@pytest.fixture
def shared(pg_url: str, seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, dict[str, str]]]:
    """An empty PostgreSQL database and a bucket of the test's own, and this process pointed at the bucket: what two
    nodes share (each node is a `zoo` run with a data dir of its own)."""
    truncate_all(pg_url)
    env = seaweedfs.env(seaweedfs.new_bucket())
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield pg_url, env


def _zoo(url: str, data_dir: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[dict]]:
    """`zoo --json` run in this process as a node with its own data dir."""
    capsys.readouterr()
    rc = main(["--db", url, "--data-dir", str(data_dir), *args, "--json"])
    out = capsys.readouterr().out
    return rc, [json.loads(line) for line in out.splitlines() if line.strip()]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_a_node_with_an_empty_data_dir_serves_what_another_ingested(
    shared: tuple[str, dict[str, str]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url, _ = shared
    sources = write_random_peft_adapters(tmp_path / "sources", 8)
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    rc, ingested = _zoo(url, a, "ingest", "--no-embed", str(tmp_path / "sources"), "--base-model", "tiny", capsys=capsys)
    assert rc == 0 and {r["status"] for r in ingested} == {"ingested"}
    rc, _ = _zoo(url, a, "embed", capsys=capsys)
    assert rc == 0 and not (a / "blobs").exists()  # the blobs are in the bucket, and only there
    first = next(r["adapter_id"] for r in ingested if r["source"] == str(sources[0]))
    rc, (on_a,) = _zoo(url, a, "search", str(first), "-k", "5", capsys=capsys)
    assert rc == 0 and on_a["module_stage"].startswith("exact")
    rc, _ = _zoo(url, a, "export", str(first), "--format", "peft", "--out", str(tmp_path / "from-a"), capsys=capsys)
    shutil.rmtree(a)  # node A is gone: B shares nothing local with it

    with monkeypatch.context() as down:  # node C, while the bucket does not answer
        for name, value in {"ZOO_S3_ENDPOINT_URL": f"http://127.0.0.1:{_closed_port()}", "ZOO_S3_MAX_ATTEMPTS": "1"}.items():
            down.setenv(name, value)
        rc, (on_c,) = _zoo(url, tmp_path / "node-c", "search", str(first), "-k", "5", capsys=capsys)
        assert rc == 0 and on_c["module_stage"] == "module sketches (no module store)"  # the sketches stand in
        rc = main(["--db", url, "--data-dir", str(tmp_path / "node-c"), "export", str(first), "--format", "peft", "--out", "c"])
        assert rc == 2 and "does not answer" in capsys.readouterr().err

    with caplog.at_level(logging.INFO, logger="embed.serving.engine"):
        rc, (on_b,) = _zoo(url, b, "search", str(first), "-k", "5", capsys=capsys)
    assert rc == 0 and on_b["results"] == on_a["results"] and on_b["module_stage"] == on_a["module_stage"]
    assert all(state.startswith("built on this node from the database in ") for state in on_b["index_states"].values())
    assert "module store built on this node in" in caplog.text and "built on this node in" in caplog.text
    assert sorted(p.parent.name for p in b.rglob("*.safetensors")) == ["rerank"] and list((b / "index").glob("*.index"))
    rc, (again,) = _zoo(url, b, "search", str(first), "-k", "5", capsys=capsys)
    assert rc == 0 and set(again["index_states"].values()) == {"loaded"} and again["results"] == on_a["results"]

    rc, (shown,) = _zoo(url, b, "show", str(first), capsys=capsys)
    assert rc == 0 and shown["name"] == sources[0].name
    rc, _ = _zoo(url, b, "export", str(first), "--format", "peft", "--out", str(tmp_path / "from-b"), capsys=capsys)
    assert rc == 0
    exported = sorted(p.name for p in (tmp_path / "from-b").iterdir())
    assert exported and all((tmp_path / "from-b" / n).read_bytes() == (tmp_path / "from-a" / n).read_bytes() for n in exported)
    rc, (report,) = _zoo(url, b, "check", capsys=capsys)
    assert rc == 0 and report["ok"] and report["blobs"]["rows"] == 8


def _large_kohya_file(path: Path, modules: int = 4, width: int = 2048, rank: int = 256) -> Path:
    """A kohya-style LoRA file whose canonical factors make a blob of several S3 parts (about 5 MB a module)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(7)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(modules):
        stem = f"lora_unet_down_blocks_0_attentions_{i}_transformer_blocks_0_attn1_to_q"
        tensors[f"{stem}.lora_down.weight"] = torch.randn(rank, width, generator=g)
        tensors[f"{stem}.lora_up.weight"] = torch.randn(width, rank, generator=g) * 0.01
        tensors[f"{stem}.alpha"] = torch.tensor(float(rank))
    save_file(tensors, str(path), metadata={"ss_network_dim": str(rank)})
    return path


@pytest.mark.slow
def test_a_writer_killed_mid_upload_leaves_what_check_finds_and_repair_clears(
    shared: tuple[str, dict[str, str]], seaweedfs: SeaweedFS, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, env = shared
    bucket = env["ZOO_BLOB_URL"].removeprefix("s3://").split("/")[0]
    source = _large_kohya_file(tmp_path / "large.safetensors")
    node = tmp_path / "node"
    # in parts, one at a time: a window to kill in
    slow = {"ZOO_S3_PART_BYTES": str(MIN_PART_BYTES), "ZOO_S3_MULTIPART_BYTES": str(MIN_PART_BYTES), "ZOO_S3_CONCURRENCY": "1"}
    command = [
        sys.executable,
        "-m",
        "zoo.cli",
        "--db",
        url,
        "--data-dir",
        str(node),
        "ingest",
        "--no-embed",
        str(source),
        "--base-model",
        "big",
    ]
    writer = subprocess.Popen(command, env={**os.environ, **env, **slow}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client, deadline = seaweedfs.client(), time.monotonic() + 60
    try:
        while not client.list_multipart_uploads(Bucket=bucket).get("Uploads"):
            assert writer.poll() is None, f"the ingest ended before its upload was seen: {writer.communicate()[1][-2000:]!r}"
            assert time.monotonic() < deadline, "no multipart upload began"
            time.sleep(0.01)
        writer.send_signal(signal.SIGKILL)  # mid-upload: some parts up, the upload never completed
    finally:
        writer.kill()
        writer.wait(timeout=30)
    (upload,) = client.list_multipart_uploads(Bucket=bucket)["Uploads"]
    assert client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0  # nothing half-written is visible

    rc, (report,) = _zoo(url, node, "check", "--repair", capsys=capsys)  # the default grace: it may be a live writer's
    assert rc == 0 and report["in_flight"] == 1 and report["removed"] == 0
    rc, (report,) = _zoo(url, node, "check", "--grace", "0", capsys=capsys)
    half_done = f"s3://{bucket}/{upload['Key']}?uploadId={upload['UploadId']}"
    assert rc == 1 and not report["ok"] and report["temporary_files"] == [half_done] and report["blobs"]["rows"] == 0
    rc, (repaired,) = _zoo(url, node, "check", "--repair", "--grace", "0", capsys=capsys)
    assert rc == 0 and repaired["ok"] and repaired["removed"] == 1
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")
