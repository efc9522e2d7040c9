"""A deadline for one call's work, checked where the work loops (cooperative cancellation).

A thread cannot be stopped from outside, and torch or numpy work in one cannot be interrupted: the web app's
pool (webapp/context.py) runs an expensive call under `until(deadline)`, and the loops such a call spends its
time in (canonicalization per group of modules, module sketches per module, predictions per id) call `check()`
between steps, so a call past its time limit raises `TimeLimitError` at its next step and stops using CPU.
Outside `until` (the command line, the worker) `check()` does nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from zoo.errors import ZooError

_DEADLINE: ContextVar[float | None] = ContextVar("zoo_deadline", default=None)


class TimeLimitError(ZooError):
    """An expensive call ran past the app's time limit (ZOO_TIME_LIMIT_S); its work stopped at its next step."""

    http_status = 503
    error_type = "unavailable"


@contextmanager
def until(deadline: float) -> Iterator[None]:
    """Work in this block (this thread) is past its time at `deadline` (time.monotonic())."""
    token = _DEADLINE.set(deadline)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def remaining() -> float | None:
    """Seconds left to this thread's deadline (None without one)."""
    deadline = _DEADLINE.get()
    return None if deadline is None else deadline - time.monotonic()


def check() -> None:
    """Raise TimeLimitError if this thread's work is past its deadline."""
    check_at(_DEADLINE.get())


def check_at(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise TimeLimitError("the request ran past its time limit and was stopped; try a smaller upload or fewer ids")
