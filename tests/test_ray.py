"""Jobs on Ray (zoo/runners/ray.py), on 2 CPUs of this machine: `zoo ingest --ray` on a new local instance
(both databases), and on a cluster of two nodes started apart with `ray start`, each with a data dir of its own
(PostgreSQL): `zoo crawl --ray ADDRESS`, whose workers see only the environment the driver passes on, with one of
its ingest tasks killed mid-job; `zoo ingest --ray ADDRESS` with blobs in a bucket (a real SeaweedFS), each node
working in its own data dir; and with blobs in the data dir, a node that cannot see the driver's refusing the run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import func, select

from tests.conftest import CLI, truncate_all
from tests.factories import write_random_peft_adapters
from tests.hub_server import FakeRepo, HubServer
from tests.seaweedfs import SeaweedFS
from zoo.config import Settings
from zoo.store.models import Adapter, JobItem, Label, Measurement
from zoo.store.session import session_factory

pytest.importorskip("ray", reason="ray is not installed: pip install 'zoo[ray]' (CI installs it)")

pytestmark = pytest.mark.slow
BASE = "org/tiny-base"


def zoo(cli: CLI, *args: str, env: dict[str, str] | None = None, **kw: object) -> subprocess.Popen:
    """`zoo` in its own process (Ray stays out of pytest's)."""
    cmd = [sys.executable, "-m", "zoo.cli", "--db", cli.settings.database_url, "--data-dir", str(cli.settings.data_dir), *args]
    return subprocess.Popen(cmd, env=env or dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)  # type: ignore[call-overload]


def seeded(cli: CLI, root: Path, base_model: str = "tiny") -> None:
    """A schema, and four seeds embedded: the space has an embedder, so what the run stores gets embedded."""
    write_random_peft_adapters(root / "seeds", 4, seed=1000)
    assert cli("init")[0] == 0
    assert cli("ingest", str(root / "seeds"), "--base-model", base_model)[0] == 0
    assert cli("embed")[0] == 0


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # Ray against PostgreSQL: the crawl test below
def test_ingest_on_a_local_ray_instance_with_labels(cli: CLI, tmp_path: Path) -> None:
    seeded(cli, tmp_path)
    sources = write_random_peft_adapters(tmp_path / "src", 8)
    (tmp_path / "src" / "broken.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")  # truncated header
    seed = next(p for p in sorted((tmp_path / "seeds").iterdir()) if p.is_dir())
    shutil.copytree(seed, tmp_path / "src" / "copy-of-a-seed")  # what a run before stored: a duplicate
    labels = tmp_path / "labels.csv"
    labels.write_text("name,task,test_accuracy\n" + "".join(f"{p.name},task{i % 2},0.{i + 1}\n" for i, p in enumerate(sources)))
    args = ("ingest", str(tmp_path / "src"), "--base-model", "tiny", "--labels", str(labels), "--ray", "--json")

    proc = zoo(cli, *args)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]  # one source failed
    summary = json.loads(out.splitlines()[-1])
    assert (summary["done"], summary["duplicate"], summary["failed"], summary["embedded"]) == (8, 1, 1, {"tiny": 8}), summary
    assert summary["ray"]["cpus"] == 2 and summary["concurrency"] == 2
    [failed] = summary["failures"]
    assert failed["source"].endswith("broken.safetensors") and "broken.safetensors" in failed["reason"]
    assert summary["job"]["state"] == "done" and summary["job"]["created_by"] == "ingest --ray"

    with session_factory(cli.settings.database_url)() as session:
        stored = dict(session.execute(select(Adapter.name, Adapter.id).where(Adapter.base_model == "tiny")).all())
        tasks = dict(session.execute(select(Label.adapter_id, Label.value).where(Label.key == "task")).all())
        accuracy = dict(session.execute(select(Measurement.adapter_id, Measurement.value)).all())
    for i, p in enumerate(sources):  # each source's CSV row reached whichever task ingested it
        assert tasks[stored[p.name]] == f"task{i % 2}" and accuracy[stored[p.name]] == pytest.approx(float(f"0.{i + 1}"))
    assert cli("check")[0] == 0  # every adapter embedded, indexes current


@dataclass(frozen=True)
class Cluster:
    """Two Ray nodes of one CPU each on this machine, started with `ray start`: `address` to join, with the token
    authentication `auth` (the variables a driver needs), each node's ZOO_DATA_DIR (the environment its `ray start`
    ran in, without the Hub's or zoo's other variables), and `hidden`, a directory the second node cannot see (it runs
    in a mount namespace of its own with an empty tmpfs over it; None where this machine refuses one)."""

    address: str
    auth: dict[str, str]
    node_dirs: tuple[Path, Path]
    hidden: Path | None


def _stop_ray(temp: str) -> None:
    """Kill the processes of the Ray nodes whose temp dir is `temp`, and their children (their workers), by pid:
    `ray stop` would stop every Ray node of the machine."""
    ours: set[int] = set()
    parents: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if temp.encode() in (proc / "cmdline").read_bytes():
                ours.add(int(proc.name))
            parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    ours |= {pid for pid, parent in parents.items() if parent in ours}
    for pid in ours:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _in_own_mount_namespace(hidden: Path) -> list[str]:
    """A command prefix running what follows with an empty tmpfs over `hidden`, in a mount namespace of its own; [] where
    this machine does not allow one (no unshare, or not privileged)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    prefix = [unshare, "-m", "--propagation", "private", "sh", "-c", 'mount -t tmpfs zoo-hidden "$0" && exec "$@"', str(hidden)]
    probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    return prefix if probe.returncode == 0 else []


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A Ray cluster of two one-CPU nodes on this machine (Cluster), shared by this module's tests."""
    ray_cli = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    temp = tempfile.mkdtemp(prefix="zray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    root = tmp_path_factory.mktemp("nodes")
    node_dirs = (root / "node-1", root / "node-2")
    hidden = root / "hidden"
    hidden.mkdir()
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}  # whether ~/.ray holds a token or not
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("HF_", "ZOO_"))}, **auth}
    port = 6400 + os.getpid() % 500
    common = ["--num-cpus", "1", "--num-gpus", "0", "--disable-usage-stats"]
    try:
        head = [ray_cli, "start", "--head", *common, "--port", str(port), "--temp-dir", temp, "--include-dashboard", "false"]
        started = subprocess.run(
            head, env={**env, "ZOO_DATA_DIR": str(node_dirs[0])}, check=True, capture_output=True, text=True, timeout=180
        )
        address = re.search(r"ray start --address='([^']+)'", started.stdout + started.stderr)  # the node's own IP and port
        assert address, started.stdout + started.stderr
        namespace = _in_own_mount_namespace(hidden)
        second = [*namespace, ray_cli, "start", "--address", address.group(1), *common]
        subprocess.run(second, env={**env, "ZOO_DATA_DIR": str(node_dirs[1])}, check=True, capture_output=True, text=True, timeout=180)
        yield Cluster(address.group(1), auth, node_dirs, hidden if namespace else None)
    finally:
        _stop_ray(temp)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def pg_cli(pg_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> CLI:
    truncate_all(pg_url)
    return CLI(Settings(data_dir=tmp_path / "data", database_url=pg_url), capsys)


@pytest.mark.postgres
def test_crawl_on_a_ray_cluster_survives_a_killed_task(pg_cli: CLI, ray_cluster: Cluster, tmp_path: Path) -> None:
    cli = pg_cli
    seeded(cli, tmp_path, BASE)
    count = 40
    with HubServer(page_size=16) as hub:
        for i, path in enumerate(write_random_peft_adapters(tmp_path / "hub", count)):
            files = {"README.md": f"---\nbase_model: {BASE}\n---\n".encode()}
            hub.repos[f"user{i % 5}/lora-{i}"] = FakeRepo.from_dir(path, files, tags=["peft", f"base_model:adapter:{BASE}"])
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "ZOO_JOB_LEASE_S": "2", **ray_cluster.auth}
        env.pop("HF_TOKEN", None)
        driver = zoo(cli, "crawl", "--base-model", BASE, "--ray", ray_cluster.address, "--json", env=env)
        sessions = session_factory(cli.settings.database_url)
        victim, deadline = None, time.monotonic() + 240
        while victim is None:  # kill the process of a task while it holds an item
            assert driver.poll() is None and time.monotonic() < deadline, driver.communicate()[1][-3000:]
            with sessions() as session:
                done = session.scalar(select(func.count()).where(JobItem.state.in_(("done", "duplicate"))))
                held = session.execute(select(JobItem.id, JobItem.lease_owner).where(JobItem.state == "running")).first()
            if done >= 5 and held is not None:
                victim = held
                os.kill(int(held.lease_owner.split(":")[1]), signal.SIGKILL)  # owner = host:pid:thread
            time.sleep(0.05)
        out, err = driver.communicate(timeout=300)
    assert driver.returncode == 0, err[-3000:]
    summary = json.loads(out.splitlines()[-1])
    counts = summary["job"]["counts"]
    # the killed task may have committed its adapter before it died: the item's second attempt finds it stored (duplicate)
    assert summary["failures"] == [] and counts["done"] + counts["duplicate"] == count and counts["duplicate"] <= 1, summary
    assert summary["embedded"] == {BASE: count}  # stored under the base model their cards name
    with sessions() as session:
        items = session.execute(select(JobItem.id, JobItem.attempts, JobItem.adapter_id, JobItem.source)).all()
        stored = session.scalar(select(func.count()).select_from(Adapter))
        sources = set(session.scalars(select(Adapter.source_uri).where(Adapter.source_uri.like("hf://%"))))
    assert {i.attempts for i in items if i.id == victim.id} == {2}  # taken over once its lease ran out
    assert len({i.adapter_id for i in items}) == count and stored == count + 4  # each repo stored once
    assert sources == {i.source for i in items}
    assert cli("check")[0] == 0  # the killed task's adapters embedded too, indexes current


@pytest.mark.postgres
def test_nodes_with_data_dirs_of_their_own_share_only_the_database_and_the_bucket(
    pg_url: str,
    seaweedfs: SeaweedFS,
    ray_cluster: Cluster,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    truncate_all(pg_url)
    bucket = seaweedfs.env(seaweedfs.new_bucket())
    for name, value in bucket.items():
        monkeypatch.setenv(name, value)
    seeded(CLI(Settings(data_dir=tmp_path / "seed", database_url=pg_url), capsys), tmp_path)
    write_random_peft_adapters(tmp_path / "src", 6)
    driver = tmp_path / "driver"
    driver.write_text("a file: nothing can be written under the driver's data dir")
    command = [sys.executable, "-m", "zoo.cli", "--db", pg_url, "--data-dir", str(driver), "ingest", str(tmp_path / "src")]
    args = [*command, "--base-model", "tiny", "--ray", ray_cluster.address, "--json"]
    ran = subprocess.run(args, env={**os.environ, **bucket, **ray_cluster.auth}, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    summary = json.loads(ran.stdout.splitlines()[-1])
    assert (summary["done"], summary["failed"], summary["embedded"]) == (6, 0, {"tiny": 6}), summary
    assert summary["ray"]["nodes"] == 2 and sorted(summary["ray"]["data_dirs"].values()) == [str(d) for d in ray_cluster.node_dirs]
    # the embedding actor built the space's caches in its node's own data dir; no node keeps a blob
    assert [d.name for d in ray_cluster.node_dirs if list(d.glob("index/*.index"))] in (["node-1"], ["node-2"])
    assert not [p for d in ray_cluster.node_dirs for p in d.rglob("*") if "blobs" in p.parts]
    with session_factory(pg_url)() as session:
        assert session.scalar(select(func.count()).select_from(Adapter)) == 4 + 6


@pytest.mark.postgres
def test_with_blobs_in_the_data_dir_a_node_that_cannot_see_it_refuses_the_run(pg_url: str, ray_cluster: Cluster, tmp_path: Path) -> None:
    if ray_cluster.hidden is None:
        pytest.skip("a node that cannot see a directory needs a mount namespace of its own (unshare -m, privileged)")
    truncate_all(pg_url)
    unseen = ray_cluster.hidden / "driver"  # this process and the first node see it; the second an empty tmpfs there
    write_random_peft_adapters(tmp_path / "src", 2)
    command = [sys.executable, "-m", "zoo.cli", "--db", pg_url, "--data-dir", str(unseen), "ingest", str(tmp_path / "src")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZOO_BLOB_URL", "ZOO_S3_"))}  # blobs in the data dir
    env |= ray_cluster.auth
    ran = subprocess.run([*command, "--ray", ray_cluster.address], env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 2 and f"cannot see this command's data dir {unseen}: with blobs in the data dir" in ran.stderr, ran.stderr
    with session_factory(pg_url)() as session:  # refused before any item was claimed
        states = session.execute(select(JobItem.state, JobItem.attempts)).all()
    assert states and set(states) == {("queued", 0)}
    assert not list(unseen.glob(".ray-driver-*"))  # the driver's file is gone
