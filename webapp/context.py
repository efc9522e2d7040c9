"""What a web process holds: settings, the session factory, the blob store, one query engine, and
a small pool that runs expensive calls under a time limit. One per app, in `app.extensions["zoo"]`."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from flask import current_app, g
from sqlalchemy.orm import Session, sessionmaker

from embed.engine import QueryEngine
from zoo.blobs import BlobStore
from zoo.config import Settings
from zoo.db.session import session_factory
from zoo.errors import ZooError

T = TypeVar("T")


class TimeLimitError(ZooError):
    """An expensive call ran past the app's time limit."""

    http_status = 503


@dataclass
class WebConfig:
    """The web app's own settings (Flask config keys, or ZOO_* environment variables)."""

    #: `POST /api/v1/ingest` may name paths under this directory only (None: paths are refused)
    import_root: Path | None = None
    #: uploads larger than this are refused with 413
    max_upload_bytes: int = 256 << 20
    #: read endpoints need a token too
    read_token_required: bool = False
    #: seconds an expensive call (an upload read and canonicalized, a prediction) may take
    time_limit_s: float = 60.0

    @classmethod
    def from_env(cls, overrides: dict[str, object]) -> WebConfig:
        def pick(key: str, default: object) -> object:
            return overrides.get(key, os.environ.get(key, default))

        root = pick("ZOO_IMPORT_ROOT", None)
        return cls(
            import_root=Path(str(root)).expanduser().resolve() if root else None,
            max_upload_bytes=int(pick("ZOO_MAX_UPLOAD_BYTES", cls.max_upload_bytes)),  # type: ignore[arg-type]
            read_token_required=str(pick("ZOO_READ_TOKEN_REQUIRED", "0")).lower() in ("1", "true", "yes"),
            time_limit_s=float(pick("ZOO_TIME_LIMIT_S", cls.time_limit_s)),  # type: ignore[arg-type]
        )


@dataclass
class ZooContext:
    settings: Settings
    web: WebConfig
    sessions: sessionmaker[Session]
    blobs: BlobStore
    engine: QueryEngine
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(max_workers=4, thread_name_prefix="zoo-call"))
    jobs: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(max_workers=1, thread_name_prefix="zoo-job"))

    @classmethod
    def open(cls, settings: Settings, web: WebConfig) -> ZooContext:
        sessions = session_factory(settings.database_url)
        blobs = BlobStore(settings.blob_dir)
        return cls(settings, web, sessions, blobs, QueryEngine(sessions, blobs, settings.data_dir))

    def limited(self, fn: Callable[[], T]) -> T:
        """fn() in the pool, or TimeLimitError past the time limit (the call finishes in the background)."""
        future = self.pool.submit(fn)
        try:
            return future.result(timeout=self.web.time_limit_s)
        except FutureTimeout:
            raise TimeLimitError(f"the request took longer than {self.web.time_limit_s:g} s; try a smaller upload or fewer ids") from None


def zoo() -> ZooContext:
    return current_app.extensions["zoo"]  # type: ignore[no-any-return]


def db() -> Session:
    """This request's session (closed when the request ends)."""
    if "zoo_session" not in g:
        g.zoo_session = zoo().sessions()
    return g.zoo_session  # type: ignore[no-any-return]


def close_session(_exc: BaseException | None = None) -> None:
    session = g.pop("zoo_session", None)
    if session is not None:
        session.close()
