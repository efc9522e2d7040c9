"""Per-module work shared out over threads: sketching an adapter is a loop of small products, one module at a time
(a Llama-3-8B adapter has 224), each too small to split (waking an intra-op pool for one costs more than the product),
but the modules are independent. So whole modules go to a few Python threads, each running its kernels on one
thread; numpy and torch release the GIL inside them."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from threadpoolctl import threadpool_limits

from zoo import deadline

if TYPE_CHECKING:  # torch: the serving path imports this module through zoo/domain/similarity.py, without torch
    from zoo.domain.canonical import CanonicalFactors

#: the least mean factor entries (U and V) of a module for its work to go to threads: below it (an SDXL adapter's 1,035
#: modules of 10,000-50,000) the threads spend more waiting on each other for the interpreter than they save
#: (40 SDXL adapters embedded in 15.4 s on 2 threads against 14.1-15.1 on one); a Llama-3-8B module has 131,000-295,000
MIN_THREADED_ENTRIES = 1 << 16


def module_threads(adapters: Sequence[Mapping[str, CanonicalFactors]], threads: int) -> int:
    """The threads worth `for_each_module` over these adapters' modules: `threads` where their modules are large
    enough (MIN_THREADED_ENTRIES on average), else one."""
    entries = [f.U.shape[0] * f.U.shape[1] + f.V.shape[0] * f.V.shape[1] for a in adapters for f in a.values()]
    return threads if entries and sum(entries) / len(entries) >= MIN_THREADED_ENTRIES else 1


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

    with threadpool_limits(limits=1, user_api="blas"):
        # on one thread too: a product's sums then do not depend on the threads chosen, and BLAS threads spinning
        # against a busy core made 200 Llama-3-8B adapters' input-Gram sketches 20x slower (4 probes of a 14,336-wide
        # module: 10.5 s of wall time for 2 adapters of 56 modules, 0.5 s on one thread)
        if threads == 1:
            share(0)
            return
        with ThreadPoolExecutor(max_workers=threads, initializer=initializer) as pool:
            for done in [pool.submit(share, first) for first in range(threads)]:
                done.result()
