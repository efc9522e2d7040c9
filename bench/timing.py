"""Timing shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_time(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    """Median wall time of `repeats` calls of fn after one warm-up call; sync waits for queued device work."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
