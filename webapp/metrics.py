"""`GET /metrics`: Prometheus's text format (docs/deploy.md lists the metrics). Each request is timed by its route (the
URL rule, so a label never holds a raw path), method and status class; what the database knows (job items by state,
space versions, adapters) is read at scrape time.

Under `zoo serve` every worker process counts into PROMETHEUS_MULTIPROC_DIR (zoo/metrics.py), so a scrape of any one
of them reports them all. The route declares scope `read`: open, as the health check is, unless
ZOO_READ_TOKEN_REQUIRED, when a scraper sends a token (Prometheus's `authorization` setting); deploy/nginx.conf does not
pass it on from outside, and Prometheus scrapes each replica directly.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from apiflask import APIBlueprint, APIFlask
from flask import Response, g, request
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from webapp.auth import needs
from webapp.context import zoo_context
from zoo import metrics as counted
from zoo.store import gauges
from zoo.store.jobs import ITEM_STATES  # each reported, at 0 where no item is in it
from zoo.store.session import Sessions

ops = APIBlueprint("ops", __name__, enable_openapi=False)

#: methods named in the latency's labels; any other (a client may send any token) counts as OTHER
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
#: the route label of a request no URL rule matched (404s)
UNMATCHED = "<unmatched>"


class DatabaseCollector(Collector):
    """Gauges read from the database at each scrape."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self.sessions() as session:
            states, versions, adapters = gauges.item_states(session), gauges.space_versions(session), gauges.adapter_count(session)
        items = GaugeMetricFamily("zoo_job_items", "Job items by state, of every job (from the database)", labels=["state"])
        for state, count in sorted({**dict.fromkeys(ITEM_STATES, 0), **states}.items()):
            items.add_metric([state], count)
        yield items
        spaces = GaugeMetricFamily("zoo_space_version", "Each space's version, raised by every write of its embeddings", labels=["space"])
        for name, version in sorted(versions.items()):
            spaces.add_metric([name], version)
        yield spaces
        yield GaugeMetricFamily("zoo_adapters", "Adapters stored (from the database)", value=adapters)


@ops.get("/metrics")
@needs("read")
def scrape() -> Response:
    """Every process's counts and the database's gauges, in Prometheus's text format."""
    counted.note_resident()
    reg = counted.registry()
    reg.register(DatabaseCollector(zoo_context().sessions))
    body, content_type = counted.exposition(reg)
    return Response(body, content_type=content_type)


def start_timer() -> None:
    """Before every request (the first hook, so that refusals are timed too)."""
    g.zoo_started = time.perf_counter()


def observe(response: Response) -> Response:
    """After every request: its latency under its route, method and status class, and this process's memory."""
    started = g.get("zoo_started")
    if started is not None:
        route = request.url_rule.rule if request.url_rule is not None else UNMATCHED
        method = request.method if request.method in METHODS else "OTHER"
        counted.metrics().requests.labels(route, method, f"{response.status_code // 100}xx").observe(time.perf_counter() - started)
    counted.note_resident()
    return response


def register(app: APIFlask) -> None:
    """The hooks (before any other app hook) and the /metrics route."""
    app.before_request_funcs.setdefault(None, []).insert(0, start_timer)
    app.after_request(observe)
    app.register_blueprint(ops)
    counted.note_resident()  # each process reports its memory from its start
