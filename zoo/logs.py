"""Log lines a program can read: with ZOO_LOG_FORMAT=json every record is one JSON object on a line (time, level,
logger, message, and the request id and job of the work it belongs to), so that one request can be followed from the
web app into the job it made and the `zoo worker` that works on it. Unset, logs stay as they were (Python's defaults,
gunicorn's access log).

The request id lives in a context variable: the web app sets it for each request (webapp/requests.py), a worker for
each job item from the id stored with its job (zoo/runners/worker.py), and every record made meanwhile carries it.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import secrets
import sys
from collections.abc import Iterator
from datetime import UTC, datetime

from zoo import config

#: the request id of the work this thread is doing (None: none)
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("zoo_request_id", default=None)
#: the job of the item this thread is working on
JOB_ID: contextvars.ContextVar[int | None] = contextvars.ContextVar("zoo_job_id", default=None)
#: what a request id taken from a header may be: a proxy's ($request_id is 32 hex digits), a UUID, or the like
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
#: LogRecord's own attributes: anything else set on a record (logging's `extra=`) goes into the JSON object
_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


def new_request_id() -> str:
    """A fresh request id: 32 hex digits, as nginx's $request_id."""
    return secrets.token_hex(16)


def valid_request_id(value: str | None) -> str | None:
    """`value` if it may be used as a request id (REQUEST_ID_PATTERN), else None."""
    return value if value and REQUEST_ID_PATTERN.fullmatch(value) else None


@contextlib.contextmanager
def context(request_id: str | None, job_id: int | None = None) -> Iterator[None]:
    """Records made inside the block carry this request id and job."""
    tokens = REQUEST_ID.set(request_id), JOB_ID.set(job_id)
    try:
        yield
    finally:
        REQUEST_ID.reset(tokens[0])
        JOB_ID.reset(tokens[1])


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, request_id and job_id when set, the
    record's extra fields, and the traceback of an exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id, job_id = REQUEST_ID.get(), JOB_ID.get()
        if request_id is not None:
            entry["request_id"] = request_id
        if job_id is not None:
            entry["job_id"] = job_id
        entry.update({k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS and not k.startswith("_")})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def json_logs() -> bool:
    """Whether ZOO_LOG_FORMAT asks for JSON lines."""
    value = config.LOG_FORMAT.get().lower()
    if value not in ("", "text", "json"):
        raise ValueError(f"ZOO_LOG_FORMAT={value!r}: {config.LOG_FORMAT.meaning}")
    return value == "json"


def configure() -> bool:
    """Under ZOO_LOG_FORMAT=json, send every record of level INFO and up to stderr as JSON lines (a handler on the root
    logger; under `zoo serve`, gunicorn's logconfig_dict does it instead). Returns whether it did; called again, it adds
    nothing more."""
    if not json_logs():
        return False
    root = logging.getLogger()
    if not any(isinstance(h.formatter, JsonFormatter) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
        root.addHandler(handler)
    root.setLevel(min(root.level or logging.INFO, logging.INFO))
    return True


def gunicorn_logconfig() -> dict[str, object]:
    """gunicorn's `logconfig_dict` under ZOO_LOG_FORMAT=json: its master's and workers' lines, and every other
    logger's, as JSON lines on stderr (the app logs each request itself, with its id, in place of gunicorn's access
    log)."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": f"{__name__}.JsonFormatter"}},
        "handlers": {"json": handler},
        "root": {"level": "INFO", "handlers": ["json"]},
        "loggers": {
            "gunicorn.error": {"level": "INFO", "handlers": [], "propagate": True},
            "gunicorn.access": {"level": "INFO", "handlers": [], "propagate": True},
        },
    }
