"""Per-module work shared out over threads: sketching an adapter is a loop of small products, one module at a time
(a Llama-3-8B adapter has 224), each too small to split (waking an intra-op pool for one costs more than the product),
but the modules are independent. So whole modules go to a few Python threads, each running its kernels on one
thread; numpy and torch release the GIL inside them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from threadpoolctl import threadpool_limits

from zoo import deadline


def for_each_module(
    modules: Sequence[str], work: Callable[[int, str], None], threads: int, initializer: Callable[[], object] | None = None
) -> None:
    """work(m, name) for each module, on up to `threads` threads (each every threads-th module), every BLAS call on
    one thread; `initializer` runs first in each new thread (torch's thread count is a thread's own: a new one starts
    with every core, so torch work passes `torch.set_num_threads(1)`). The caller's deadline (zoo/deadline.py) is
    checked before each module, and the first error raised. `work` must write only what belongs to its module."""
    left = deadline.remaining()
    at = None if left is None else time.monotonic() + left
    threads = max(1, min(threads, len(modules)))

    def share(first: int) -> None:
        for m in range(first, len(modules), threads):
            deadline.check_at(at)
            work(m, modules[m])

    if threads == 1:
        share(0)
        return
    with threadpool_limits(limits=1, user_api="blas"), ThreadPoolExecutor(max_workers=threads, initializer=initializer) as pool:
        for done in [pool.submit(share, first) for first in range(threads)]:
            done.result()
