"""Jobs on Ray (zoo/runners/ray.py), on 2 CPUs of this machine: `zoo ingest --ray` on a new local instance
(both databases), and `zoo crawl --ray ADDRESS` on a cluster started apart with `ray start`, whose workers
see only the environment the driver passes on, with one of its ingest tasks killed mid-job (PostgreSQL)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from tests.conftest import CLI, truncate_all
from tests.factories import write_random_peft_adapters
from tests.hub_server import FakeRepo, HubServer
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


@pytest.fixture
def ray_cluster() -> Iterator[str]:
    """A one-node Ray cluster with 2 CPUs started by `ray start`, without the Hub's or zoo's variables."""
    ray_cli = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    temp = tempfile.mkdtemp(prefix="zray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "ZOO_"))}
    port = 6400 + os.getpid() % 500
    start = [ray_cli, "start", "--head", "--num-cpus", "2", "--num-gpus", "0", "--port", str(port), "--temp-dir", temp]
    started = subprocess.run(
        [*start, "--include-dashboard", "false", "--disable-usage-stats"], env=env, check=True, capture_output=True, text=True, timeout=180
    )
    address = re.search(r"ray start --address='([^']+)'", started.stdout + started.stderr)  # the node's own IP and port
    assert address, started.stdout + started.stderr
    try:
        yield address.group(1)
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def pg_cli(pg_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> CLI:
    truncate_all(pg_url)
    return CLI(Settings(data_dir=tmp_path / "data", database_url=pg_url), capsys)


@pytest.mark.postgres
def test_crawl_on_a_ray_cluster_survives_a_killed_task(pg_cli: CLI, ray_cluster: str, tmp_path: Path) -> None:
    cli = pg_cli
    seeded(cli, tmp_path, BASE)
    count = 40
    with HubServer(page_size=16) as hub:
        for i, path in enumerate(write_random_peft_adapters(tmp_path / "hub", count)):
            files = {"README.md": f"---\nbase_model: {BASE}\n---\n".encode()}
            hub.repos[f"user{i % 5}/lora-{i}"] = FakeRepo.from_dir(path, files, tags=["peft", f"base_model:adapter:{BASE}"])
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "ZOO_JOB_LEASE_S": "2", "RAY_AUTH_MODE": "token"}
        env.pop("HF_TOKEN", None)
        driver = zoo(cli, "crawl", "--base-model", BASE, "--ray", ray_cluster, "--json", env=env)
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
