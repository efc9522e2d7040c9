"""Torch thread counts for ingest work: a process's share of the cores, and one thread for small per-module kernels."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from zoo.formats import AdapterData


def share_cores(processes: int) -> int:
    """Give this process's torch its share of the machine's cores when `processes` ingest processes run on it at
    once (at least one thread): more intra-op threads than cores make every small kernel wait for descheduled
    threads. Returns the thread count."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // max(1, processes))
    torch.set_num_threads(threads)
    return threads


#: adapters with fewer factor (or matrix) elements than this are described on one torch thread: their kernels are too
#: small to share out, and waking a thread pool costs more than the work (on a busy machine, ten times more)
SMALL_ADAPTER_ELEMENTS = 1 << 20


@contextmanager
def one_torch_thread(when: bool = True) -> Iterator[None]:
    """Run the block on one torch thread (when `when`), restoring the thread count after: for loops of small
    per-module kernels, each of which would otherwise hand its work to the intra-op thread pool and wait for its
    threads (on a busy machine a 2-thread kernel of a few MB measured 100 times slower than on one thread). Torch's
    setting is per process: another thread's large adapter meanwhile runs slower, not wrong."""
    before = torch.get_num_threads()
    if before == 1 or not when:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def small_work_on_one_thread(data: AdapterData) -> contextlib.AbstractContextManager[None]:
    """Run the block on one torch thread when the adapter is small (see SMALL_ADAPTER_ELEMENTS)."""
    elements = sum(m.A.numel() + m.B.numel() for m in data.modules) + sum(fm.shape[0] * fm.shape[1] for fm in data.full_matrices)
    return one_torch_thread(elements < SMALL_ADAPTER_ELEMENTS)
