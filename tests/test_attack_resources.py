"""Resources a client can hold on a real `zoo serve`: memory a refused upload leaves behind, threads held by slow
clients, the pool that bounds searches. Timing bounds are generous (a busy 2-core CI machine)."""

from __future__ import annotations

from bench.attack import Flood, get, p99
from tests.test_attack import PROBE_P99_S, Served, _probe_during, served

__all__ = ["served"]  # the fixture, shared with tests/test_attack.py: a server of this module's own


def test_a_flood_of_small_similar_queries_is_bounded_by_the_search_pool(served: Served) -> None:
    """16 clients asking `similar` with k = 5 over and over: before, only k > 100 ran in a bounded pool, and at 32
    such clients a page probe had p50 3.4 s; now every k runs in the search pool (1 running and 1 waiting here),
    past it a 503 at once, and health stays fast."""
    with Flood(served.port, 16, get("/api/v1/adapters/3/similar?k=5")) as flood:
        times = _probe_during(served)
    assert p99(times) < PROBE_P99_S, times
    assert set(flood.statuses) <= {200, 503} and flood.statuses.get(503, 0) > 0 and flood.statuses.get(200, 0) > 0, flood.statuses
