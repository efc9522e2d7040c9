"""/metrics and request ids: the web app's counts scraped and parsed with prometheus-client's own parser, the database's
gauges, the expensive-call pools' refusals, each request's id in its response, its JSON log line and the job it makes
(followed into the app's job thread and into a real `zoo worker`), and a real `zoo serve` of two worker processes whose
counts one scrape reports together."""

from __future__ import annotations

import io
import json
import logging
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
from prometheus_client.parser import text_string_to_metric_families

from webapp import create_app
from webapp.context import BusyError, CallPool
from zoo import logs
from zoo.config import Settings
from zoo.store.jobs import create_job
from zoo.store.models import Job
from zoo.store.session import session_factory, upgrade
from zoo.store.tokens import create_token

HEALTH = "/api/v1/health"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, by name and sorted labels (prometheus-client's parser)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text) for s in family.samples}


def value(scraped: dict, name: str, **labels: str) -> float:
    return scraped.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def json_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """ZOO_LOG_FORMAT=json, and the JSON lines logged meanwhile (a handler of the test's own on the root logger; the
    one the app adds on stderr is taken off again at the end)."""
    monkeypatch.setenv("ZOO_LOG_FORMAT", "json")
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter())
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield out
    for h in root.handlers[:]:
        if h not in before:
            root.removeHandler(h)
    root.setLevel(level)


def lines(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]


def test_metrics_count_requests_by_route_and_status_and_read_the_database(settings: Settings) -> None:
    settings.data_dir.mkdir(parents=True)
    client = create_app({"ZOO_DATABASE_URL": settings.database_url, "ZOO_DATA_DIR": str(settings.data_dir)}).test_client()
    before = samples(client.get("/metrics").get_data(as_text=True))
    with session_factory(settings.database_url)() as session:
        create_job(session, ["/nowhere/a", "/nowhere/b"], {})
        session.commit()
    for _ in range(3):
        assert client.get(HEALTH).status_code == 200
    assert client.get("/api/v1/adapters/424242").status_code == 404
    assert client.get("/no/such/page/123").status_code == 404
    assert client.open("/api/v1/health", method="BREW").status_code == 405
    response = client.get("/metrics")
    assert response.status_code == 200 and response.content_type.startswith("text/plain; version=0.0.4")
    after = samples(response.get_data(as_text=True))

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    count = "zoo_http_request_duration_seconds_count"
    assert moved(count, route=HEALTH, method="GET", status="2xx") == 3
    assert moved(count, route="/api/v1/adapters/<int:adapter_id>", method="GET", status="4xx") == 1  # the rule, not the path
    assert moved(count, route="<unmatched>", method="GET", status="4xx") == 1
    assert moved(count, route="<unmatched>", method="OTHER", status="4xx") == 1  # a made-up method is no label of its own
    assert not any("424242" in str(key) or "BREW" in str(key) or "/no/such" in str(key) for key in after)
    assert value(after, "zoo_job_items", state="queued") == 2 and value(after, "zoo_job_items", state="done") == 0
    assert value(after, "zoo_adapters") == 0
    assert value(after, "zoo_process_resident_bytes") > 10 << 20
    assert ("zoo_call_pool_refused_total", (("pool", "searches"),)) in after  # both pools reported from the start


def test_a_full_pool_counts_its_refusals_and_its_calls() -> None:
    pool = CallPool(1, 0, 10.0, "test-pool")
    release, started = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        release.wait(10)

    runner = threading.Thread(target=pool.run, args=(hold,))
    runner.start()
    started.wait(10)
    with pytest.raises(BusyError):
        pool.run(lambda: None)
    with pytest.raises(BusyError):
        pool.run(lambda: None)
    held = samples(_scrape_here())
    release.set()
    runner.join()
    done = samples(_scrape_here())
    assert value(held, "zoo_call_pool_refused_total", pool="test-pool") == 2
    assert value(held, "zoo_call_pool_calls", pool="test-pool") == 1
    assert value(done, "zoo_call_pool_calls", pool="test-pool") == 0


def _scrape_here() -> str:
    from zoo import metrics

    return metrics.exposition(metrics.registry())[0].decode()


def test_each_request_has_an_id_a_forged_one_is_not_trusted_and_json_logs_carry_it(
    settings: Settings, json_log: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.data_dir.mkdir(parents=True)
    client = create_app({"ZOO_DATABASE_URL": settings.database_url, "ZOO_DATA_DIR": str(settings.data_dir)}).test_client()
    ids = [client.get(HEALTH).headers["X-Request-ID"] for _ in range(3)]
    assert len(set(ids)) == 3 and all(len(i) == 32 for i in ids)
    forged = client.get(HEALTH, headers={"X-Request-ID": "forged-by-a-client"}).headers["X-Request-ID"]
    assert forged != "forged-by-a-client"  # not behind a proxy that sets it: never taken from a client
    monkeypatch.setenv("ZOO_TRUST_REQUEST_ID", "1")
    assert client.get(HEALTH, headers={"X-Request-ID": "from-the-proxy"}).headers["X-Request-ID"] == "from-the-proxy"
    bad = client.get(HEALTH, headers={"X-Request-ID": "two words\tand a tab"}).headers["X-Request-ID"]
    assert bad != "two words\tand a tab" and logs.valid_request_id(bad)
    refused = client.delete("/api/v1/adapters/1", headers={"X-Request-ID": "refused-1"})
    assert refused.status_code == 401 and refused.headers["X-Request-ID"] == "refused-1"  # refusals have their id too
    logged = {line.get("request_id"): line for line in lines(json_log) if line["logger"] == "zoo.request"}
    assert set(ids) | {forged, "from-the-proxy", bad, "refused-1"} <= set(logged)
    assert logged["from-the-proxy"]["route"] == HEALTH and logged["from-the-proxy"]["status"] == 200
    assert logged["refused-1"]["status"] == 401 and logged["refused-1"]["level"] == "info"


def test_a_job_made_by_a_request_carries_its_id_into_its_items_log_lines(
    settings: Settings, json_log: io.StringIO, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from tests.factories import write_random_peft_adapters

    settings.data_dir.mkdir(parents=True)
    root = tmp_path / "import"
    (source,) = write_random_peft_adapters(root, 1)
    with session_factory(settings.database_url).begin() as session:
        token = create_token(session, "writer", "write")[1]
    monkeypatch.setenv("ZOO_TRUST_REQUEST_ID", "1")
    app = create_app({"ZOO_DATABASE_URL": settings.database_url, "ZOO_DATA_DIR": str(settings.data_dir), "ZOO_IMPORT_ROOT": str(root)})
    client = app.test_client()
    before = samples(client.get("/metrics").get_data(as_text=True))
    headers = {"Authorization": f"Bearer {token}", "X-Request-ID": "ingest-req-1"}
    response = client.post("/api/v1/ingest", json={"paths": [source.name], "base_model": "tiny"}, headers=headers)
    assert response.status_code == 202, response.get_json()
    job_id = response.get_json()["id"]
    deadline = time.monotonic() + 20
    while client.get(f"/api/v1/jobs/{job_id}").get_json()["state"] != "done":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with session_factory(settings.database_url)() as session:
        assert session.get_one(Job, job_id).options["request_id"] == "ingest-req-1"
    items = [line for line in lines(json_log) if line["logger"] == "zoo.runners.worker"]
    assert any(i["request_id"] == "ingest-req-1" and i["job_id"] == job_id and i["state"] == "done" for i in items), items
    after = samples(client.get("/metrics").get_data(as_text=True))
    assert value(after, "zoo_ingest_items_total", state="done") - value(before, "zoo_ingest_items_total", state="done") == 1
    moved_bytes = value(after, "zoo_ingest_bytes_total") - value(before, "zoo_ingest_bytes_total")
    assert moved_bytes == sum(p.stat().st_size for p in source.iterdir() if p.is_file())
    assert value(after, "zoo_adapters") == 1 and value(after, "zoo_job_items", state="done") == 1


@pytest.mark.slow  # a real `zoo worker` process (torch imported): about 10 s
def test_zoo_worker_logs_each_item_with_the_request_id_of_its_job(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'zoo.db'}"
    upgrade(url)
    with session_factory(url).begin() as session:
        job = create_job(session, [str(tmp_path / "missing-adapter")], {"request_id": "req-into-worker"})
        session.flush()
        job_id = job.id
    env = {**os.environ, "ZOO_LOG_FORMAT": "json"}
    cmd = [sys.executable, "-m", "zoo.cli", "--db", url, "--data-dir", str(tmp_path / "data"), "worker", "--drain", "--json"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    logged = [json.loads(line) for line in run.stderr.splitlines() if line.startswith("{")]
    item = [line for line in logged if line["logger"] == "zoo.runners.worker"]
    assert item and item[0]["request_id"] == "req-into-worker" and item[0]["job_id"] == job_id and item[0]["state"] == "failed", logged


def _get(port: int, path: str) -> tuple[int, dict[str, str], str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return response.status, dict(response.headers), response.read().decode()


def _resident_pids(port: int) -> set[str]:
    """The processes whose resident memory one scrape reports."""
    return {dict(labels)["pid"] for name, labels in samples(_get(port, "/metrics")[2]) if name == "zoo_process_resident_bytes"}


@pytest.mark.slow  # a real `zoo serve` of two workers: 5-25 s as the machine is busy
def test_zoo_serve_with_two_workers_reports_every_worker_in_one_scrape(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'zoo.db'}"
    upgrade(url)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"} | {"ZOO_LOG_FORMAT": "json"}
    cmd = [sys.executable, "-m", "zoo.cli", "--db", url, "--data-dir", str(tmp_path / "data"), "serve", "--port", str(port)]
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([*cmd, "--workers", "2", "--threads", "4"], env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            try:
                workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
                if len(workers) == 2 and _get(port, HEALTH)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.3)
        # every worker is in a scrape from its start, whether or not a request has reached it (one may answer them all)
        expected = {str(int(p)) for p in workers}
        while _resident_pids(port) != expected:
            assert time.monotonic() < deadline, "a worker is missing from /metrics"
            time.sleep(0.3)
        ids = []
        pids = set()
        for _ in range(40):  # a connection each: the two workers share them
            status, headers, _body = _get(port, HEALTH)
            assert status == 200
            ids.append(headers["X-Request-ID"])
        for _ in range(6):  # whichever worker answers a scrape, it reports both workers' counts
            _, _, text = _get(port, "/metrics")
            scraped = samples(text)
            count = value(scraped, "zoo_http_request_duration_seconds_count", route=HEALTH, method="GET", status="2xx")
            assert count >= 40 + 1  # the start-up probe or probes, and the 40
            resident = {dict(labels)["pid"] for name, labels in scraped if name == "zoo_process_resident_bytes"}
            pids |= resident
        assert len(pids) == 2 and {str(int(p)) for p in workers} == pids
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    logged = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert {line.get("request_id") for line in logged if line["logger"] == "zoo.request"} >= set(ids)
    assert any(line["logger"] == "gunicorn.error" for line in logged)  # gunicorn's own lines are JSON too
