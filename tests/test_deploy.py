"""docker-compose.yml and deploy/ hold together: SeaweedFS and the bucket every node shares, two app replicas both in
nginx's upstream, each app and worker with a data dir of its own, settings that zoo reads (no misspelt ZOO_* name),
S3 credentials the object store knows; and Docker Compose (`docker compose config`, or Debian's `docker-compose`)
accepts the file and refuses a broken copy, where one is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from zoo.config import VARIABLES

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
NGINX = (ROOT / "deploy" / "nginx.conf").read_text()
APPS = ("app-1", "app-2")
WORKERS = ("worker-1", "worker-2")


def _data_volume(service: dict) -> str:
    (volume,) = [v.split(":")[0] for v in service["volumes"] if v.split(":")[1] == "/data"]
    return volume


def test_two_replicas_behind_the_proxy_and_the_workers_each_keep_a_data_dir_of_their_own() -> None:
    upstream = re.search(r"upstream zoo_app \{(.*?)\}", NGINX, re.S)
    assert upstream is not None
    servers = re.findall(r"^\s*server ([\w-]+):(\d+)", upstream.group(1), re.M)
    assert servers == [(app, "5000") for app in APPS]
    for app in APPS:
        assert "zoo serve" in " ".join(SERVICES[app]["command"]) and "--port 5000" in " ".join(SERVICES[app]["command"])
        assert "ports" not in SERVICES[app]  # only the proxy reaches a replica
    assert set(SERVICES["proxy"]["depends_on"]) == set(APPS)
    for worker in WORKERS:
        assert SERVICES[worker]["command"][:2] == ["zoo", "worker"]
    volumes = [_data_volume(SERVICES[name]) for name in (*APPS, *WORKERS)]
    assert len(set(volumes)) == len(volumes) and set(volumes) <= set(COMPOSE["volumes"])


def test_every_node_keeps_blobs_in_the_bucket_the_bucket_service_makes_with_credentials_seaweedfs_knows() -> None:
    seaweed = SERVICES["seaweedfs"]
    assert seaweed["image"].startswith("chrislusf/seaweedfs") and seaweed["command"][0] == "server" and "-s3" in seaweed["command"]
    identities = json.loads((ROOT / "deploy" / "seaweedfs-s3.json").read_text())["identities"]
    keys = {(c["accessKey"], c["secretKey"]) for i in identities for c in i["credentials"]}
    declared = {v.name for v in VARIABLES}
    for name in (*APPS, *WORKERS, "init"):
        env = SERVICES[name]["environment"]
        assert {k for k in env if k.startswith("ZOO_")} <= declared, name  # every setting one zoo reads
        bucket = re.fullmatch(r"s3://([a-z0-9.-]+)(/.*)?", env["ZOO_BLOB_URL"])
        assert bucket is not None and env["ZOO_S3_ENDPOINT_URL"] == "http://seaweedfs:8333", name
        assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]) in keys, name
        assert f"s3.bucket.create -name {bucket.group(1)}" in SERVICES["bucket"]["command"][0]
        assert {"init", "bucket"} <= set(SERVICES[name].get("depends_on", {})) or name == "init"
    for app in APPS:  # behind the proxy, which sets X-Request-ID itself: the replicas may trust it
        assert SERVICES[app]["environment"]["ZOO_TRUST_REQUEST_ID"] == "1"
        assert "proxy_set_header X-Request-ID $request_id;" in NGINX
    for worker in WORKERS:
        assert "ZOO_TRUST_REQUEST_ID" not in SERVICES[worker]["environment"]


def compose_command() -> list[str] | None:
    """A Docker Compose that validates files: the `docker compose` plugin (v2), else Debian's `docker-compose` (v1.29,
    which reads the Compose Specification's files too: `apt-get install docker-compose`); None: neither is here."""
    docker = shutil.which("docker")
    if docker is not None and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy is not None else None


def test_docker_compose_accepts_the_file_and_refuses_a_broken_copy(tmp_path: Path) -> None:
    compose = compose_command()
    if compose is None:
        pytest.skip("Docker Compose is not installed: apt-get install docker-compose, or Docker's compose plugin (CI installs one)")
    run = subprocess.run([*compose, "-f", str(ROOT / "docker-compose.yml"), "config", "-q"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    # the same file with a volume no service declares and a misspelt key: refused, so the check above checks
    text = (ROOT / "docker-compose.yml").read_text()
    broken = text.replace("- app1data:/data", "- app9data:/data").replace("    expose:", "    exposes:")
    (tmp_path / "docker-compose.yml").write_text(broken)
    run = subprocess.run([*compose, "-f", str(tmp_path / "docker-compose.yml"), "config", "-q"], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and ("app9data" in run.stderr or "exposes" in run.stderr), run.stderr
