"""The Prometheus metrics a zoo process counts itself (prometheus-client): requests, the expensive-call pools, ingest and
embed throughput, resident memory. What the database knows (job items by state, space versions) is read at scrape time
instead (webapp/metrics.py).

Several processes (gunicorn's workers, `zoo worker --concurrency N`) count into one set of metrics through
prometheus-client's multiprocess mode: PROMETHEUS_MULTIPROC_DIR names a directory every process writes its values into,
and a scrape sums them. It must be set before prometheus-client is first imported in a process: `zoo serve` and
`zoo worker` set it (`use_multiprocess_dir`) before they start theirs, and nothing imports prometheus-client before the
first metric is counted (`metrics()`, made on first use). Unset, each process counts alone.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from zoo import memory

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: the variable prometheus-client reads to count across processes
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: request latency buckets (seconds): a catalog page takes milliseconds, an upload search seconds, the time limit 60 s
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(frozen=True)
class Metrics:
    """Every metric a process counts (docs/deploy.md lists them)."""

    requests: Histogram
    pool_calls: Gauge
    pool_refused: Counter
    ingest_items: Counter
    ingest_bytes: Counter
    embedded: Counter
    resident: Gauge

    def collectors(self) -> tuple[Histogram | Gauge | Counter, ...]:
        return (self.requests, self.pool_calls, self.pool_refused, self.ingest_items, self.ingest_bytes, self.embedded, self.resident)


@functools.cache
def metrics() -> Metrics:
    """This process's metrics, made at first use (after PROMETHEUS_MULTIPROC_DIR is set, where it is), in no registry:
    a scrape builds its own (`registry`)."""
    from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics

    disable_created_metrics()  # no `_created` series beside each counter: nothing here reads them
    return Metrics(
        requests=Histogram(
            "zoo_http_request_duration_seconds",
            "Seconds from a request's arrival in the app to its response, by route (the URL rule), method and status class",
            ["route", "method", "status"],
            buckets=LATENCY_BUCKETS,
            registry=None,
        ),
        pool_calls=Gauge(
            "zoo_call_pool_calls",
            "Expensive calls accepted and not yet finished (running or waiting for a thread), by pool",
            ["pool"],
            multiprocess_mode="livesum",
            registry=None,
        ),
        pool_refused=Counter(
            "zoo_call_pool_refused", "Expensive calls refused with 503 because their pool was full, by pool", ["pool"], registry=None
        ),
        ingest_items=Counter(
            "zoo_ingest_items",
            "Job items this process finished, by outcome (done, duplicate, failed, queued, lost)",
            ["state"],
            registry=None,
        ),
        ingest_bytes=Counter("zoo_ingest_bytes", "Bytes of local source files read by job items stored or found duplicate", registry=None),
        embedded=Counter("zoo_embed_adapters", "Adapters embedded by a job's batches, by space (base model)", ["space"], registry=None),
        resident=Gauge(
            "zoo_process_resident_bytes", "Resident memory of each live zoo process (RSS)", multiprocess_mode="liveall", registry=None
        ),
    )


def note_resident() -> None:
    """Record this process's resident memory now (after each request, at each scrape, after each job item)."""
    metrics().resident.set(memory.rss_bytes())


def registry() -> CollectorRegistry:
    """A registry of everything this process's scrape reports: every process's values in multiprocess mode, else this
    process's own."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    reg = CollectorRegistry(auto_describe=True)
    if os.environ.get(MULTIPROC_ENV):
        MultiProcessCollector(reg)
    else:
        for collector in metrics().collectors():
            reg.register(collector)
    return reg


def exposition(reg: CollectorRegistry) -> tuple[bytes, str]:
    """The registry in Prometheus's text format, and its content type."""
    from prometheus_client import generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

    return generate_latest(reg), CONTENT_TYPE_PLAIN_0_0_4  # the text format every Prometheus reads


def use_multiprocess_dir(purpose: str) -> Path:
    """Count across this process and its children: PROMETHEUS_MULTIPROC_DIR as set, else a new temporary directory for
    this run (removed at exit by the caller's `clear_multiprocess_dir`). A directory left by an earlier run is emptied,
    since its files would add a dead run's counts to this one's."""
    given = os.environ.get(MULTIPROC_ENV)
    path = Path(given) if given else Path(tempfile.mkdtemp(prefix=f"zoo-{purpose}-metrics-"))
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):
        stale.unlink(missing_ok=True)
    os.environ[MULTIPROC_ENV] = str(path)
    return path


def clear_multiprocess_dir(path: Path, made: bool) -> None:
    """Remove a run's temporary metrics directory (only one `use_multiprocess_dir` made)."""
    if made:
        shutil.rmtree(path, ignore_errors=True)


def process_exited(pid: int) -> None:
    """A child process that counted into the multiprocess directory has exited: its live gauges go (its counters stay)."""
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Expose this process's metrics (and its children's, in multiprocess mode) on http://host:port/metrics in a
    daemon thread: `zoo worker --metrics-port`."""
    from prometheus_client import start_http_server

    start_http_server(port, addr=host, registry=registry())
