"""Nodes that share only PostgreSQL and a bucket (a real SeaweedFS, tests/seaweedfs.py), each with a data dir of its own:
a web upload taken by `zoo worker`s on other nodes (and stored as what was uploaded, not as a path on one of them), a
W2T checkpoint trained on one node and loaded on another, two `zoo serve` replicas behind nginx (deploy/nginx.conf)
that each find what the other ingested, and what a web app killed while it puts an upload in the bucket leaves there
for `zoo check` to find and `--repair` to clear."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from tests.conftest import truncate_all
from tests.factories import write_random_peft_adapters
from tests.seaweedfs import SeaweedFS
from webapp import create_app
from zoo.cli import main
from zoo.store.models import Adapter
from zoo.store.s3_blobs import MIN_PART_BYTES
from zoo.store.session import session_factory
from zoo.store.tokens import create_token

pytestmark = pytest.mark.slow

NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
#: seconds within which an adapter ingested through one replica is found through the other (docs/deploy.md)
REPLICA_BOUND_S = 5.0


@pytest.fixture
def shared(pg_url: str, seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, dict[str, str]]]:
    """An empty PostgreSQL database and a bucket of the test's own, this process pointed at the bucket: all that the
    nodes share."""
    truncate_all(pg_url)
    env = seaweedfs.env(seaweedfs.new_bucket())
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield pg_url, env


def _zoo(url: str, data_dir: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> list[dict]:
    """`zoo --json` run in this process as a node with its own data dir; its JSON lines."""
    capsys.readouterr()
    rc = main(["--db", url, "--data-dir", str(data_dir), *args, "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out[-2000:]
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def _token(url: str) -> dict[str, str]:
    with session_factory(url).begin() as session:
        return {"Authorization": f"Bearer {create_token(session, 'nodes', 'write')[1]}"}


def _files(path: Path) -> dict:
    return {"file": [(io.BytesIO((path / n).read_bytes()), n) for n in ("adapter_config.json", "adapter_model.safetensors")]}


def test_workers_on_other_nodes_take_a_web_upload_and_a_third_node_loads_the_trained_checkpoint(
    shared: tuple[str, dict[str, str]], seaweedfs: SeaweedFS, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, env = shared
    bucket, prefix = env["ZOO_BLOB_URL"].removeprefix("s3://").split("/", 1)
    sources = write_random_peft_adapters(tmp_path / "sources", 10)
    web_dir = tmp_path / "web"
    # the web node leaves its jobs to the workers: each upload waits in the bucket for one of them
    app = create_app({"ZOO_DATABASE_URL": url, "ZOO_DATA_DIR": str(web_dir), "ZOO_WEB_JOBS": "0"})
    client, auth = app.test_client(), _token(url)
    jobs = []
    for path in sources:
        r = client.post("/api/v1/ingest", data={**_files(path), "base_model": "tiny"}, headers=auth, content_type="multipart/form-data")
        assert r.status_code == 202, r.json
        jobs.append(r.json["id"])
    assert not any((web_dir / "uploads").iterdir())  # the uploads are in the bucket, and only there
    listed = seaweedfs.client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/files/uploads/")
    uploads = {o["Key"].split("/")[3] for o in listed["Contents"]}
    assert len(uploads) == len(sources)

    cmd = [sys.executable, "-m", "zoo.cli", "--db", url]
    workers = [
        subprocess.Popen([*cmd, "--data-dir", str(tmp_path / f"worker-{i}"), "worker", "--drain"], env={**os.environ, **env},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for i in (1, 2)
    ]  # fmt: skip
    for worker in workers:
        out = worker.communicate(timeout=120)[0].decode()
        assert worker.returncode == 0, out[-3000:]
    states = [client.get(f"/api/v1/jobs/{job}").json for job in jobs]
    assert [s["state"] for s in states] == ["done"] * len(sources), states
    ids = sorted(i["adapter_id"] for s in states for i in s["items"])
    assert len(set(ids)) == len(sources)
    with session_factory(url)() as session:  # stored as what was uploaded, whichever node ingested it
        recorded = set(session.scalars(select(Adapter.source_uri).where(Adapter.id.in_(ids))))
    assert recorded == {f"upload:{hex_}/adapter_config.json+adapter_model.safetensors" for hex_ in uploads}
    assert not seaweedfs.client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/files/uploads/").get("Contents")
    assert not [p for i in (1, 2) for p in (tmp_path / f"worker-{i}" / "uploads").glob("*")]  # the fetched copies are gone

    for i, adapter in enumerate(ids):  # labels through the web node, for the predictors
        body = {"labels": {"task": "ab"[i % 2]}, "measurements": {"test_accuracy": 0.5 + i / 40}}
        assert client.put(f"/api/v1/adapters/{adapter}/labels", json=body, headers=auth).status_code == 200
    trainer = tmp_path / "worker-1"
    (trained,) = _zoo(url, trainer, "train", "--epochs", "1", "--members", "1", capsys=capsys)
    checkpoint = Path(trained["checkpoint"]).relative_to(trainer).as_posix()
    listed = seaweedfs.client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/files/{checkpoint}/")
    assert f"{prefix}/files/{checkpoint}/MANIFEST.json" in {o["Key"] for o in listed["Contents"]}
    (on_trainer,) = _zoo(url, trainer, "predict", str(ids[0]), capsys=capsys)
    (found_there,) = _zoo(url, trainer, "search", str(ids[0]), "-k", "5", capsys=capsys)

    replica = tmp_path / "replica"  # an empty data dir: the checkpoint, indexes and module store come from elsewhere
    (on_replica,) = _zoo(url, replica, "predict", str(ids[0]), capsys=capsys)
    assert (replica / checkpoint).is_dir()
    assert on_replica["attributes"] == on_trainer["attributes"] and on_replica["predictors"] == on_trainer["predictors"]
    (found_here,) = _zoo(url, replica, "search", str(ids[0]), "-k", "5", capsys=capsys)
    assert found_here["results"] == found_there["results"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    except OSError:
        return 0, {}


def _nginx(root: Path, port: int, upstreams: list[int]) -> list[str]:
    """deploy/nginx.conf with its listen port and the two replicas' addresses rewritten (as tests/test_attack.py runs
    it); the command that runs it."""
    conf = (DEPLOY / "nginx.conf").read_text()
    temp = "".join(f"    {kind}_temp_path {root}/{kind};\n" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    for old, new in (
        ("server app-1:5000 ", f"server 127.0.0.1:{upstreams[0]} "),
        ("server app-2:5000 ", f"server 127.0.0.1:{upstreams[1]} "),
        ("listen 8080;", f"listen 127.0.0.1:{port};"),
        ("access_log /dev/stdout zoo;", f"access_log {root}/access.log zoo;"),
        ("http {", "http {\n" + temp),
    ):
        assert conf.count(old) == 1, old
        conf = conf.replace(old, new)
    for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (root / kind).mkdir(mode=0o777)
        (root / kind).chmod(0o777)  # nginx's workers may run as another user
    (root / "nginx.conf").write_text(conf)
    for name in ("zoo_api_errors", "zoo_page_errors"):
        shutil.copy(DEPLOY / name, root / name)
    return [
        str(NGINX),
        "-p",
        str(root),
        "-c",
        str(root / "nginx.conf"),
        "-e",
        str(root / "error.log"),
        "-g",
        f"daemon off; pid {root}/nginx.pid;",
    ]


def test_an_adapter_ingested_through_one_replica_is_found_through_the_other_within_the_bound(
    shared: tuple[str, dict[str, str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if NGINX is None:
        pytest.skip("nginx is not installed: apt-get install nginx-light (CI installs it)")
    url, env = shared
    sources = write_random_peft_adapters(tmp_path / "sources", 9)
    for path in sources[:8]:
        shutil.copytree(path, tmp_path / "zoo" / path.name)
    _zoo(url, tmp_path / "seed", "ingest", str(tmp_path / "zoo"), "--base-model", "tiny", capsys=capsys)  # and embedded
    auth = _token(url)

    ports = [_free_port(), _free_port()]
    logs = [(tmp_path / f"replica-{i}.log").open("wb") for i in (1, 2)]
    replicas = [
        subprocess.Popen(
            [sys.executable, "-m", "zoo.cli", "--db", url, "--data-dir", str(tmp_path / f"replica-{i + 1}"), "serve", "--port", str(port),
             "--workers", "1"],
            env={**os.environ, **env, "ZOO_TRUST_REQUEST_ID": "1"}, stdout=log, stderr=subprocess.STDOUT,
        )
        for i, (port, log) in enumerate(zip(ports, logs, strict=True))
    ]  # fmt: skip
    (tmp_path / "nginx").mkdir()
    proxy_port = _free_port()
    proxy = None
    try:
        deadline = time.monotonic() + 90
        while not all(_get(port, "/api/v1/health")[0] == 200 for port in ports):
            assert all(r.poll() is None for r in replicas) and time.monotonic() < deadline, (tmp_path / "replica-1.log").read_text()[-3000:]
            time.sleep(0.2)
        for port in ports:  # each replica has built its index from the database (its data dir was empty)
            assert _get(port, "/api/v1/adapters/1/similar?k=3")[0] == 200
        proxy = subprocess.Popen(_nginx(tmp_path / "nginx", proxy_port, ports), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while _get(proxy_port, "/api/v1/health")[0] != 200:
            assert proxy.poll() is None and time.monotonic() < deadline, (tmp_path / "nginx" / "error.log").read_text()
            time.sleep(0.1)

        body = (
            b"".join(
                b'--zz\r\nContent-Disposition: form-data; name="file"; filename="%s"\r\n\r\n%s\r\n'
                % (n.encode(), (sources[8] / n).read_bytes())
                for n in ("adapter_config.json", "adapter_model.safetensors")
            )
            + b'--zz\r\nContent-Disposition: form-data; name="base_model"\r\n\r\ntiny\r\n--zz--\r\n'
        )
        request = urllib.request.Request(
            f"http://127.0.0.1:{proxy_port}/api/v1/ingest", data=body, method="POST",
            headers={**auth, "Content-Type": "multipart/form-data; boundary=zz"},
        )  # fmt: skip
        start = time.monotonic()
        with urllib.request.urlopen(request, timeout=30) as r:
            assert r.status == 202
            job = json.loads(r.read())["id"]
        adapter = None
        while adapter is None:
            _, detail = _get(proxy_port, f"/api/v1/jobs/{job}")
            adapter = next((i["adapter_id"] for i in detail.get("items", []) if i["state"] == "done"), None)
            assert time.monotonic() - start < 60, detail
            time.sleep(0.05)
        found: dict[int, float] = {}
        while len(found) < len(ports) and time.monotonic() - start < 60:
            for port in ports:
                status, near = _get(port, f"/api/v1/adapters/{adapter}/similar?k=3") if port not in found else (0, {})
                if status == 200 and near["results"]:
                    found[port] = time.monotonic() - start
            time.sleep(0.05)
        print(f"ingested and searchable on both replicas {found} s after the upload's 202")
        assert len(found) == len(ports) and max(found.values()) <= REPLICA_BOUND_S, found
    finally:
        for process in [*replicas, *([proxy] if proxy else [])]:
            process.terminate()
        for process in [*replicas, *([proxy] if proxy else [])]:
            process.wait(timeout=30)
        for log in logs:
            log.close()


#: a web app in a process of its own, as `zoo serve` runs one: it posts the upload given as PEFT folder, leaving the job
#: to the workers (ZOO_WEB_JOBS=0), and prints the job's id once it answers
_UPLOADER = """
import io, sys
from pathlib import Path
from webapp import create_app
from zoo.store.session import session_factory
from zoo.store.tokens import create_token
url, data_dir, folder = sys.argv[1:4]
with session_factory(url).begin() as session:
    token = create_token(session, "uploader", "write")[1]
app = create_app({"ZOO_DATABASE_URL": url, "ZOO_DATA_DIR": data_dir, "ZOO_WEB_JOBS": "0"})
files = [(io.BytesIO((Path(folder) / n).read_bytes()), n) for n in ("adapter_config.json", "adapter_model.safetensors")]
r = app.test_client().post("/api/v1/ingest", data={"file": files, "base_model": "big"}, headers={"Authorization": f"Bearer {token}"})
print(r.status_code, r.json.get("id"), flush=True)
"""


def _large_peft(folder: Path, modules: int = 6, width: int = 1024, rank: int = 256) -> Path:
    """A PEFT folder whose weights take several S3 parts (about 2 MB a module)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(3)
    targets = [f"base_model.model.layers.{i}.self_attn.q_proj" for i in range(modules)]
    tensors = {}
    for t in targets:
        tensors[f"{t}.lora_A.weight"] = torch.randn(rank, width, generator=g)
        tensors[f"{t}.lora_B.weight"] = torch.randn(width, rank, generator=g) * 0.01
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": ["q_proj"], "base_model_name_or_path": "big"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def test_an_upload_cut_off_in_the_bucket_by_a_killed_web_app_is_found_by_check_and_cleared_by_repair(
    shared: tuple[str, dict[str, str]], seaweedfs: SeaweedFS, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url, env = shared
    bucket, prefix = env["ZOO_BLOB_URL"].removeprefix("s3://").split("/", 1)
    uploads = f"{prefix}/files/uploads/"
    _zoo(url, tmp_path / "init", "init", capsys=capsys)
    live = create_app({"ZOO_DATABASE_URL": url, "ZOO_DATA_DIR": str(tmp_path / "web-1"), "ZOO_WEB_JOBS": "0"})
    (source,) = write_random_peft_adapters(tmp_path / "small", 1)
    r = live.test_client().post("/api/v1/ingest", data={**_files(source), "base_model": "tiny"}, headers=_token(url))
    assert r.status_code == 202  # its job waits for a worker: its upload in the bucket is a live one's

    client = seaweedfs.client()
    (waiting,) = {o["Key"].split("/")[3] for o in client.list_objects_v2(Bucket=bucket, Prefix=uploads)["Contents"]}
    slow = {"ZOO_S3_PART_BYTES": str(MIN_PART_BYTES), "ZOO_S3_CONCURRENCY": "1"}  # one part at a time: a window to kill in
    command = [sys.executable, "-c", _UPLOADER, url, str(tmp_path / "web-2"), str(_large_peft(tmp_path / "large"))]
    uploader = subprocess.Popen(command, env={**os.environ, **env, **slow}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    try:
        while not client.list_multipart_uploads(Bucket=bucket, Prefix=uploads).get("Uploads"):
            assert uploader.poll() is None, f"the upload ended before it was seen going up: {uploader.communicate()}"
            assert time.monotonic() < deadline, "no upload of the weights began"
            time.sleep(0.01)
        uploader.send_signal(signal.SIGKILL)  # the weights part-way up, no manifest, no job
    finally:
        uploader.kill()
        uploader.wait(timeout=30)
    (cut,) = {u["Key"].split("/")[3] for u in client.list_multipart_uploads(Bucket=bucket, Prefix=uploads)["Uploads"]}
    where = f"s3://{bucket}/{uploads}{cut}/"

    node = tmp_path / "checker"  # a node of its own: what it reports is in the bucket
    (report,) = _zoo(url, node, "check", capsys=capsys)  # the default grace: a young folder may be a live writer's
    assert report["ok"] and report["bucket_uploads"]["orphans"] == [] and len(report["bucket_uploads"]["in_flight"]) == 2
    capsys.readouterr()
    assert main(["--db", url, "--data-dir", str(node), "check", "--grace", "0", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    (orphan,) = report["bucket_uploads"]["orphans"]
    assert orphan["where"] == where and not orphan["complete"] and not orphan["owned"]
    assert orphan["files"] == 2  # the config, and the weights' upload cut off
    assert 0 <= orphan["age_s"] < 120
    (kept,) = report["bucket_uploads"]["in_flight"]
    assert kept["owned"] and kept["complete"] and kept["where"].endswith(f"/{waiting}/")
    capsys.readouterr()
    assert main(["--db", url, "--data-dir", str(node), "check", "--grace", "0"]) == 1
    assert f"orphaned upload {where}: 2 files, never put up whole, last written" in capsys.readouterr().out

    (repaired,) = _zoo(url, node, "check", "--repair", "--grace", "0", capsys=capsys)
    assert repaired["ok"] and repaired["bucket_uploads"]["removed"] == 1
    left = {o["Key"].split("/")[3] for o in client.list_objects_v2(Bucket=bucket, Prefix=uploads)["Contents"]}
    assert left == {waiting} and not client.list_multipart_uploads(Bucket=bucket, Prefix=uploads).get("Uploads")
    (again,) = _zoo(url, node, "check", "--grace", "0", capsys=capsys)
    assert again["ok"] and again["bucket_uploads"]["orphans"] == []
