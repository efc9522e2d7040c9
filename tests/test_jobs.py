"""Ingestion jobs and workers (zoo/store/jobs.py, zoo/runners/worker.py): claims, leases and heartbeats on SQLite and
PostgreSQL; `zoo jobs` and `zoo worker` on real adapters; and with real processes on PostgreSQL, two
workers and the web app (`zoo serve`) ingesting the same sources at once, and a worker killed mid-job."""

from __future__ import annotations

import html
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import func, select

from tests.conftest import CLI, truncate_all
from tests.factories import write_random_peft_adapters
from zoo.cli import main
from zoo.errors import NotFoundError
from zoo.runners.worker import Heartbeat
from zoo.store import tokens
from zoo.store.job_resources import cancel_job, get_job, retry_job
from zoo.store.jobs import MAX_ATTEMPTS, claim_items, create_job, finish_item, release_item
from zoo.store.models import Adapter, JobItem
from zoo.store.session import session_factory

#: distinct real PEFT adapters the process tests ingest
SOURCES = 200


def _job(url: str, sources: list[str], **options: object) -> int:
    with session_factory(url).begin() as session:
        return create_job(session, sources, options).id


def _items(url: str, job_id: int) -> list[dict]:
    with session_factory(url)() as session:
        return get_job(session, job_id)["items"]  # type: ignore[return-value]


# --- claims, leases, heartbeats (both databases) -----------------------------------------------------


def test_concurrent_claimers_never_share_an_item(db_url: str) -> None:
    job = _job(db_url, [f"/nowhere/{i}" for i in range(60)])
    sessions = session_factory(db_url)
    start = threading.Barrier(4)
    got: dict[str, list[int]] = {}

    def claimer(name: str) -> None:
        start.wait()
        mine: list[int] = []
        while claims := claim_items(sessions, name, 30, limit=2):
            mine += [c.item_id for c in claims]
        got[name] = mine

    threads = [threading.Thread(target=claimer, args=(f"c{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    items = _items(db_url, job)
    claimed = sorted(i for ids in got.values() for i in ids)
    assert claimed == sorted(i["id"] for i in items)  # every item, each once
    owner = {i: name for name, ids in got.items() for i in ids}
    assert all(i["state"] == "running" and i["attempts"] == 1 and i["lease_owner"] == owner[i["id"]] for i in items)


def test_an_expired_lease_goes_to_another_worker_and_the_late_result_is_dropped(db_url: str) -> None:
    job = _job(db_url, ["/nowhere/a"])
    sessions = session_factory(db_url)
    (a,) = claim_items(sessions, "A", 2.0)  # long enough that a busy machine still asks B within it
    assert claim_items(sessions, "B", 30) == []  # held
    time.sleep(2.1)
    (b,) = claim_items(sessions, "B", 30)
    assert (b.item_id, b.attempt) == (a.item_id, 2)
    assert not finish_item(sessions, "A", a.item_id, "failed", reason="late")
    assert release_item(sessions, "A", a.item_id, "late") is None
    assert finish_item(sessions, "B", b.item_id, "duplicate", timings={"read": 0.5})
    assert not finish_item(sessions, "B", b.item_id, "done")  # finished already
    with session_factory(db_url)() as session:
        detail = get_job(session, job)
    (item,) = detail["items"]  # type: ignore[misc]
    assert (item["state"], item["reason"], item["attempts"], item["lease_owner"]) == ("duplicate", None, 2, None)
    assert detail["state"] == "done" and detail["finished_at"]


def test_a_heartbeat_keeps_the_lease_until_the_item_is_dropped(db_url: str) -> None:
    _job(db_url, ["/nowhere/a"])
    sessions = session_factory(db_url)
    beat = Heartbeat(sessions, lease_s=1.0)
    (a,) = claim_items(sessions, "A", 1.0)
    beat.hold("A", a.item_id)
    time.sleep(2.5)
    assert claim_items(sessions, "B", 30) == []
    beat.drop(a.item_id)
    time.sleep(1.3)
    assert [c.item_id for c in claim_items(sessions, "B", 30)] == [a.item_id]


def test_an_item_stops_after_max_attempts(db_url: str) -> None:
    sessions = session_factory(db_url)
    killed = _job(db_url, ["/nowhere/killed"])
    for attempt in range(1, MAX_ATTEMPTS + 1):  # each worker dies holding it
        (c,) = claim_items(sessions, f"w{attempt}", 0.05, job_id=killed)
        assert c.attempt == attempt
        time.sleep(0.1)
    assert claim_items(sessions, "w", 30, job_id=killed) == []
    with session_factory(db_url)() as session:
        detail = get_job(session, killed)
    assert detail["state"] == "done" and detail["items"][0]["state"] == "failed"  # type: ignore[index]
    assert f"{MAX_ATTEMPTS} attempts" in detail["items"][0]["reason"]  # type: ignore[index]

    broken = _job(db_url, ["/nowhere/broken"])
    for attempt in range(1, MAX_ATTEMPTS + 1):  # each attempt raises something the worker did not expect
        (c,) = claim_items(sessions, "w", 30, job_id=broken)
        assert release_item(sessions, "w", c.item_id, "/nowhere/broken: RuntimeError: boom") == (
            "queued" if attempt < MAX_ATTEMPTS else "failed"
        )
    (item,) = _items(db_url, broken)
    assert item["state"] == "failed" and "RuntimeError: boom" in item["reason"] and "given up" in item["reason"]


def test_cancel_then_retry(db_url: str) -> None:
    sessions = session_factory(db_url)
    job = _job(db_url, ["/x/1", "/x/2", "/x/3"])
    (c,) = claim_items(sessions, "A", 30, job_id=job)
    out = cancel_job(sessions, job)
    assert (out["state"], out["cancelled_items"], out["counts"]["running"], out["finished_at"]) == ("cancelled", 2, 1, None)  # type: ignore[index]
    assert claim_items(sessions, "B", 30) == []
    assert finish_item(sessions, "A", c.item_id, "failed", reason="boom")  # the running item finishes
    with session_factory(db_url)() as session:
        assert get_job(session, job, items=False)["finished_at"]
    out = retry_job(sessions, job)
    assert (out["state"], out["requeued"], out["counts"]["queued"]) == ("queued", 3, 3)  # type: ignore[index]
    again = claim_items(sessions, "B", 30, limit=10)
    assert len(again) == 3 and {x.attempt for x in again} == {1}
    with pytest.raises(NotFoundError):
        retry_job(sessions, 999)


def test_progress_throughput_eta_and_slowest_stage(db_url: str) -> None:
    sessions = session_factory(db_url)
    job = _job(db_url, [f"/x/{i}" for i in range(4)])
    a, b = claim_items(sessions, "A", 30, limit=2, job_id=job)
    time.sleep(0.2)
    assert finish_item(sessions, "A", a.item_id, "failed", reason="bad", timings={"read": 0.1, "store": 0.3})
    assert finish_item(sessions, "A", b.item_id, "duplicate", timings={"read": 0.3, "store": 0.5})
    with session_factory(db_url)() as session:
        d = get_job(session, job, items=False)
    assert d["state"] == "running" and d["processed"] == 2
    assert d["stages"] == pytest.approx({"read": 0.2, "store": 0.4}) and d["slowest_stage"] == "store"
    assert d["elapsed_s"] >= 0.2 and d["throughput"] == pytest.approx(2 / d["elapsed_s"], rel=0.01)  # type: ignore[operator]
    assert d["eta_s"] == pytest.approx(2 / d["throughput"], abs=0.1)  # type: ignore[operator]


# --- zoo jobs and zoo worker (both databases) ------------------------------------------------------------


def test_zoo_jobs_and_zoo_worker(cli: CLI, tmp_path: Path) -> None:
    write_random_peft_adapters(tmp_path / "src", 6)
    missing = tmp_path / "later"
    assert cli("init")[0] == 0
    rc, out, _ = cli("jobs", "add", str(tmp_path / "src"), str(missing), "--base-model", "tiny", "--json")
    job = json.loads(out)
    assert rc == 0 and job["state"] == "queued" and job["counts"]["queued"] == 7
    rc, out, _ = cli("jobs", "list")
    assert rc == 0 and out.splitlines()[1].split()[:4] == [str(job["id"]), "queued", "7", "0"]

    rc, out, _ = cli("worker", "--drain", "--json")
    summary = json.loads(out)
    assert rc == 0 and (summary["processed"], summary["done"], summary["failed"], summary["embedded"]) == (7, 6, 1, {})
    rc, out, _ = cli("jobs", "show", str(job["id"]))
    lines = out.splitlines()
    assert lines[0].startswith(f"job {job['id']}: done") and lines[1] == "  7 items: 6 done, 1 failed"
    assert "items/s" in lines[2] and "slowest stage:" in lines[3]
    assert str(missing) in lines[-1]  # the failed source, with its reason
    detail = json.loads(cli("jobs", "show", str(job["id"]), "--json")[1])
    assert detail["slowest_stage"] in detail["stages"] and {"read", "store"} <= set(detail["stages"])
    assert len({i["adapter_id"] for i in detail["items"] if i["state"] == "done"}) == 6

    write_random_peft_adapters(tmp_path / "copy", 1)
    (tmp_path / "copy" / "0000").rename(missing)  # the failed source now exists: a copy of src/0000
    rc, out, _ = cli("jobs", "retry", str(job["id"]))
    assert rc == 0 and "1 item queued again" in out
    assert json.loads(cli("worker", "--drain", "--json")[1])["duplicate"] == 1
    counts = json.loads(cli("jobs", "show", str(job["id"]), "--json")[1])["counts"]
    assert (counts["done"], counts["duplicate"], counts["failed"]) == (6, 1, 0)
    assert json.loads(cli("worker", "--drain", "--job", str(job["id"]), "--json")[1])["processed"] == 0  # nothing left to do

    # once the space has an embedder, what workers store is embedded, and `zoo check` finds the indexes current
    assert cli("embed", "--json")[0] == 0
    write_random_peft_adapters(tmp_path / "more", 3, seed=1)
    cli("jobs", "add", str(tmp_path / "more"), "--base-model", "tiny")
    assert json.loads(cli("worker", "--drain", "--json", "--embed-every", "2")[1])["embedded"] == {"tiny": 3}
    assert cli("check")[0] == 0

    cancelled = json.loads(cli("jobs", "add", str(tmp_path / "src"), "--json")[1])["id"]
    rc, out, _ = cli("jobs", "cancel", str(cancelled))
    assert rc == 0 and out.splitlines()[0].startswith(f"job {cancelled}: cancelled") and "6 items cancelled" in out
    assert json.loads(cli("worker", "--drain", "--json")[1])["processed"] == 0
    rc, _, err = cli("worker", "--drain", "--job", "999")
    assert rc != 0 and "no job with id 999" in err


def test_a_jobs_items_carry_the_base_model_warning_and_guess_as_zoo_ingest_prints_them(cli: CLI, tmp_path: Path) -> None:
    """A job's item says what `zoo ingest` prints for its source: a --base-model the module shapes contradict (a warning)
    and the base model guessed from the shapes (a note), in the REST job, on the job's page and in `zoo jobs show`, for
    paths and uploads the web app's job thread ingests and for items `zoo worker` works."""
    from webapp import create_app
    from zoo.reference.real_shapes import write_adapter

    root = tmp_path / "root"
    sd15 = [write_adapter("sd1.5", root, family=0, member=m, layers=1, name_base=False) for m in range(3)]
    sdxl = "stabilityai/stable-diffusion-xl-base-1.0"
    assert cli("init")[0] == 0
    settings = cli.settings
    app = create_app({"ZOO_DATABASE_URL": settings.database_url, "ZOO_DATA_DIR": str(settings.data_dir), "ZOO_IMPORT_ROOT": str(root)})
    client = app.test_client()
    with session_factory(settings.database_url).begin() as session:
        _, token = tokens.create_token(session, "warnings", "write")
    auth = {"Authorization": f"Bearer {token}"}

    def finished(r) -> dict:  # type: ignore[no-untyped-def]
        assert r.status_code == 202, r.get_json()
        for _ in range(600):
            job = client.get(f"/api/v1/jobs/{r.json['id']}").json
            if job["state"] == "done":
                return job
            time.sleep(0.05)
        raise AssertionError(job)

    said = "names the sdxl family, but the module shapes are sd1.x's"
    job = finished(client.post("/api/v1/ingest", json={"paths": [sd15[0].name], "base_model": sdxl}, headers=auth))
    (item,) = job["items"]
    assert item["state"] == "done" and len(item["warnings"]) == 1 and said in item["warnings"][0], item
    assert f"<strong>warning:</strong> {item['warnings'][0]}" in html.unescape(client.get(f"/jobs/{job['id']}").get_data(as_text=True))

    upload = {"file": [(io.BytesIO(sd15[1].read_bytes()), sd15[1].name)]}
    r = client.post("/api/v1/ingest", data=upload, headers=auth, content_type="multipart/form-data")
    (item,) = finished(r)["items"]
    assert item["state"] == "done" and item["warnings"] == [], item
    assert "base model guessed from shapes: sd1.x, from 35 of 35 modules" in item["notes"], item

    rc, out, _ = cli("jobs", "add", str(sd15[2]), "--base-model", sdxl, "--json")
    job = json.loads(out)["id"]
    assert cli("worker", "--drain", "--json")[0] == 0
    (item,) = json.loads(cli("jobs", "show", str(job), "--json")[1])["items"]
    assert item["state"] == "done" and said in item["warnings"][0], item
    rc, out, _ = cli("jobs", "show", str(job))
    assert rc == 0 and f"warning: {item['warnings'][0]}" in out, out


# --- real processes on PostgreSQL --------------------------------------------------------------------


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SOURCES distinct PEFT adapters under one directory (and seeds/: four more, for the space's first embedder)."""
    root = tmp_path_factory.mktemp("jobs")
    write_random_peft_adapters(root / "adapters", SOURCES)
    write_random_peft_adapters(root / "seeds", 4, seed=1000)
    return root


def _zoo(url: str, data: Path, *args: str, env: dict[str, str] | None = None, **kw: object) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "zoo.cli", "--db", url, "--data-dir", str(data), *args]
    return subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)  # type: ignore[call-overload]


def _seeded(url: str, root: Path, data: Path) -> None:
    """An empty database holding the four seeds, embedded (so that the space has its module-sketch embedder)."""
    truncate_all(url)
    base = ["--db", url, "--data-dir", str(data)]
    assert main([*base, "ingest", str(root / "seeds"), "--base-model", "tiny", "--json"]) == 0  # and embedded


def _check(url: str, data: Path) -> dict:
    proc = _zoo(url, data, "check", "--json")
    out, err = proc.communicate(timeout=120)
    report = json.loads(out)
    assert proc.returncode == 0 and report["ok"], (report, err)
    return report


def _stored_once(url: str, job_ids: list[int], expected: int) -> dict[str, int]:
    """Every item of the jobs done or duplicate, each source mapped to one adapter, stored once."""
    with session_factory(url)() as session:
        items = session.execute(select(JobItem.source, JobItem.state, JobItem.adapter_id).where(JobItem.job_id.in_(job_ids))).all()
        adapters = session.scalar(select(func.count()).select_from(Adapter))
        hashes = session.scalar(select(func.count(Adapter.canonical_hash.distinct())))
    assert {state for _, state, _ in items} <= {"done", "duplicate"}
    by_source: dict[str, set[int]] = {}
    for source, _, adapter_id in items:
        by_source.setdefault(Path(source).name, set()).add(adapter_id)
    assert len(by_source) == expected and all(len(ids) == 1 for ids in by_source.values())
    assert len({next(iter(ids)) for ids in by_source.values()}) == expected
    assert adapters == hashes == expected + 4  # the seeds, and each source once
    return {name: next(iter(ids)) for name, ids in by_source.items()}


@pytest.fixture
def server(pg_url: str, sources: Path, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """`zoo serve` on a free port over the seeded PostgreSQL zoo (import root: the sources' directory)."""
    data = tmp_path / "data"
    _seeded(pg_url, sources, data)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _zoo(pg_url, data, "serve", "--port", str(port), "--workers", "1", "--threads", "2", env={"ZOO_IMPORT_ROOT": str(sources)})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"{url}/api/v1/health", timeout=2):
                    break
            except OSError:
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                time.sleep(0.1)
        yield url, data
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


@pytest.mark.slow
@pytest.mark.postgres
def test_two_workers_and_the_web_app_ingest_the_same_sources_once(pg_url: str, sources: Path, server: tuple[str, Path]) -> None:
    url, data = server
    seed_id = _get(f"{url}/api/v1/adapters?per_page=1")["results"][0]["id"]
    assert len(_get(f"{url}/api/v1/adapters/{seed_id}/similar?k=1000&method=sketch")["results"]) == 3  # the engine holds the space
    with session_factory(pg_url).begin() as session:
        _, token = tokens.create_token(session, "jobs-test", "write")
    base = ["--db", pg_url, "--data-dir", str(data)]
    queued = _job(pg_url, [str(p) for p in sorted((sources / "adapters").iterdir())], base_model="tiny")
    workers = [_zoo(pg_url, data, "worker", "--drain", "--json") for _ in range(2)]
    body = json.dumps({"paths": ["adapters"], "base_model": "tiny"}).encode()
    request = urllib.request.Request(
        f"{url}/api/v1/ingest", body, {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        assert r.status == 202
        web_job = json.loads(r.read())["id"]
    summaries = []
    for w in workers:
        out, err = w.communicate(timeout=180)
        assert w.returncode == 0, err[-3000:]
        summaries.append(json.loads(out.splitlines()[-1]))
    for _ in range(600):
        detail = _get(f"{url}/api/v1/jobs/{web_job}")
        if detail["state"] == "done":
            break
        time.sleep(0.1)
    assert detail["state"] == "done" and detail["counts"]["failed"] == 0 and detail["throughput"] > 0
    assert all(s["processed"] > 0 and s["failed"] == 0 for s in summaries)
    assert sum(s["processed"] for s in summaries) < 2 * SOURCES  # the web app's job thread took its share
    stored = _stored_once(pg_url, [queued, web_job], SOURCES)
    assert main([*base, "jobs", "show", str(queued)]) == 0
    # the running server's engine found the new adapters (embedded in batches by whoever stored them), without a restart
    found = {h["adapter_id"] for h in _get(f"{url}/api/v1/adapters/{seed_id}/similar?k=1000&method=sketch")["results"]}
    assert set(stored.values()) <= found
    _check(pg_url, data)


@pytest.mark.slow
@pytest.mark.postgres
def test_a_worker_killed_mid_job_loses_nothing(pg_url: str, sources: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    _seeded(pg_url, sources, data)
    count = 80
    job = _job(pg_url, [str(p) for p in sorted((sources / "adapters").iterdir())[:count]], base_model="tiny")
    lease = {"ZOO_JOB_LEASE_S": "2"}
    worker = _zoo(pg_url, data, "worker", "--concurrency", "2", "--json", env=lease, start_new_session=True)
    sessions = session_factory(pg_url)
    stranded: list[int] = []
    deadline = time.monotonic() + 120
    while not stranded:  # stop the whole worker (parent and children) at a moment it holds an item, then kill it
        assert time.monotonic() < deadline and worker.poll() is None
        with sessions() as session:
            done = session.scalar(select(func.count()).where(JobItem.job_id == job, JobItem.state.in_(("done", "duplicate"))))
        if done < 10:
            time.sleep(0.05)
            continue
        os.killpg(worker.pid, signal.SIGSTOP)
        with sessions() as session:
            stranded = list(session.scalars(select(JobItem.id).where(JobItem.job_id == job, JobItem.state == "running")))
        os.killpg(worker.pid, signal.SIGKILL if stranded else signal.SIGCONT)
        time.sleep(0.02)
    worker.communicate(timeout=30)
    assert done < count  # killed mid-job

    restarted = _zoo(pg_url, data, "worker", "--drain", "--json", env=lease)
    out, err = restarted.communicate(timeout=180)
    assert restarted.returncode == 0, err[-3000:]
    with sessions() as session:
        detail = get_job(session, job)
    assert detail["state"] == "done" and detail["counts"]["failed"] == 0
    attempts = {i["id"]: i["attempts"] for i in detail["items"]}  # type: ignore[attr-defined]
    assert all(attempts[i] == 2 for i in stranded)  # taken over once their lease ran out
    _stored_once(pg_url, [job], count)
    report = _check(pg_url, data)  # every adapter embedded (the killed worker's last batch too), indexes match the database
    assert report["blobs"]["rows"] == count + 4 and not report["unembedded"]
