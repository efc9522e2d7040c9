"""What a web process holds: settings, the session factory, the blob store, one query engine, and
a small pool that runs expensive calls under a time limit. One per app, in `app.extensions["zoo"]`.

The pool is bounded twice: ZOO_CALL_WORKERS threads run calls (default 2 per process) and at most
ZOO_CALL_QUEUE more wait (default 2); a call beyond that is refused at once with 503 and `Retry-After`
(`BusyError`), so a flood of expensive calls never holds the server's request threads. A call runs under
a deadline (zoo/deadline.py) at ZOO_TIME_LIMIT_S from when it was accepted: waiting counts, its loops stop
at their next step once past it, and its slot is free only when its thread is."""

from __future__ import annotations

import math
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from flask import Response, current_app, g, request

from embed.serving.engine import QueryEngine
from zoo import config, deadline, memory
from zoo.config import Settings
from zoo.deadline import TimeLimitError
from zoo.errors import ZooError
from zoo.metrics import metrics
from zoo.store.blob_backends import open_blob_store
from zoo.store.blobs import BlobStore
from zoo.store.session import Session, Sessions, read_snapshot, session_factory

T = TypeVar("T")

__all__ = ["BusyError", "CallPool", "TimeLimitError", "WebConfig", "ZooContext", "db", "zoo_context"]

#: seconds a request waits past its call's deadline for the call to notice it (the call's next step)
GRACE_S = 1.0


class BusyError(ZooError):
    """The pool for expensive calls is full: try again in `retry_after` seconds."""

    http_status = 503
    error_type = "unavailable"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class CallPool:
    """`workers` threads for expensive calls and at most `queue` calls waiting; see the module's doc."""

    def __init__(self, workers: int, queue: int, time_limit_s: float, name: str = "calls") -> None:
        self.workers, self.queue, self.time_limit_s = workers, queue, time_limit_s
        self.name = name  # the pool's label in the metrics (zoo/metrics.py)
        metrics().pool_calls.labels(name)  # reported from the start, at 0
        metrics().pool_refused.labels(name)
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="zoo-call")
        self._slots = threading.BoundedSemaphore(workers + queue)
        self._lock = threading.Lock()
        self.running = 0  # calls accepted and not finished (running or waiting), timed-out ones included

    def _release(self) -> None:
        with self._lock:
            self.running -= 1
        metrics().pool_calls.labels(self.name).dec()
        self._slots.release()

    def run(self, fn: Callable[[], T]) -> T:
        """fn() in the pool under the deadline; BusyError when the pool is full, TimeLimitError past the limit."""
        if not self._slots.acquire(blocking=False):
            metrics().pool_refused.labels(self.name).inc()
            retry = max(1, math.ceil(self.time_limit_s * (self.queue + self.workers) / self.workers / 4))
            raise BusyError(f"the server is busy with {self.workers + self.queue} expensive calls; try again in {retry} s", retry)
        end = time.monotonic() + self.time_limit_s
        with self._lock:
            self.running += 1
        metrics().pool_calls.labels(self.name).inc()

        def call() -> T:
            try:
                deadline.check_at(end)  # waited past the limit in the queue: nothing to do
                with deadline.until(end):
                    return fn()
            except BaseException as exc:
                # the frames fn ran in hold what it read (an upload's bytes): their locals go now, not when a
                # full garbage collection finds the traceback's cycles (their lines still show in a log)
                traceback.clear_frames(exc.__traceback__)
                raise
            finally:
                memory.trim()  # what the call freed goes back to the system (zoo/memory.py)
                self._release()

        future = self._executor.submit(call)
        try:
            return future.result(timeout=max(0.0, end - time.monotonic()) + GRACE_S)
        except FutureTimeout:
            if future.cancel():  # it never started, so call() will not release its slot
                self._release()
            raise TimeLimitError(f"the request took longer than {self.time_limit_s:g} s; try a smaller upload or fewer ids") from None
        finally:
            del future  # the future holds the call's exception, whose traceback holds this frame: no cycle left behind


@dataclass
class WebConfig:
    """The web app's own settings (Flask config keys, or ZOO_* environment variables)."""

    #: `POST /api/v1/ingest` may name paths under this directory only (None: paths are refused)
    import_root: Path | None = None
    #: uploads larger than this are refused with 413
    max_upload_bytes: int = config.MAX_UPLOAD_BYTES.default
    #: read endpoints need a token too
    read_token_required: bool = config.READ_TOKEN_REQUIRED.default
    #: seconds an expensive call (an upload read and canonicalized, a prediction) may take
    time_limit_s: float = config.TIME_LIMIT_S.default
    #: threads for expensive calls, and calls that may wait for one (per process)
    call_workers: int = config.CALL_WORKERS.default
    call_queue: int = config.CALL_QUEUE.default
    #: the app works on the ingestion jobs it queues (else `zoo worker`s on any node do)
    run_jobs: bool = config.WEB_JOBS.default

    @classmethod
    def from_env(cls, overrides: dict[str, object]) -> WebConfig:
        """The settings of zoo.config, each from the app's config keys (`overrides`) or the environment."""
        root = config.IMPORT_ROOT.get(overrides)
        return cls(
            import_root=Path(root).expanduser().resolve() if root else None,
            max_upload_bytes=config.MAX_UPLOAD_BYTES.get(overrides),
            read_token_required=config.READ_TOKEN_REQUIRED.get(overrides),
            time_limit_s=config.TIME_LIMIT_S.get(overrides),
            call_workers=max(1, config.CALL_WORKERS.get(overrides)),
            call_queue=max(0, config.CALL_QUEUE.get(overrides)),
            run_jobs=config.WEB_JOBS.get(overrides),
        )


@dataclass
class ZooContext:
    settings: Settings
    web: WebConfig
    sessions: Sessions
    blobs: BlobStore
    engine: QueryEngine
    pool: CallPool
    #: searches by a stored adapter (`similar`, any k): a pool of the same size as `pool`, so that a flood of either
    #: kind neither holds the request threads nor starves the other
    searches: CallPool
    jobs: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="zoo-job"))

    @classmethod
    def open(cls, settings: Settings, web: WebConfig) -> ZooContext:
        sessions = session_factory(settings.database_url)
        blobs = open_blob_store(settings)
        pool = CallPool(web.call_workers, web.call_queue, web.time_limit_s, "calls")
        searches = CallPool(web.call_workers, web.call_queue, web.time_limit_s, "searches")
        return cls(settings, web, sessions, blobs, QueryEngine(sessions, blobs, settings.data_dir), pool, searches)

    def limited(self, fn: Callable[[], T], pool: CallPool | None = None) -> T:
        """fn() in a bounded pool (`pool`, by default the one for expensive calls) under the time limit (see
        CallPool.run); a refusal's Retry-After is kept for the response (`retry_after()`)."""
        try:
            return (pool or self.pool).run(fn)
        except BusyError as exc:
            g.zoo_retry_after = exc.retry_after
            raise


def retry_after(response: Response) -> Response:
    """An after-request hook: a 503 says when to try again (the pool's estimate, else the time limit)."""
    if response.status_code == 503 and "Retry-After" not in response.headers:
        response.headers["Retry-After"] = str(g.get("zoo_retry_after") or max(1, math.ceil(zoo_context().web.time_limit_s)))
    return response


def zoo_context() -> ZooContext:
    return current_app.extensions["zoo"]


def db() -> Session:
    """This request's session (closed when the request ends); a read's (GET, HEAD) reads one snapshot
    (zoo.store.session.read_snapshot): a page or resource never mixes rows from before and after a concurrent delete."""
    if "zoo_session" not in g:
        session = zoo_context().sessions()
        g.zoo_session = read_snapshot(session) if request.method in ("GET", "HEAD") else session
    return g.zoo_session


def close_session(_exc: BaseException | None = None) -> None:
    session = g.pop("zoo_session", None)
    if session is not None:
        session.close()
