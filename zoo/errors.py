"""Errors that name the file and the reason, for users to act on."""

from __future__ import annotations

from pathlib import Path


class ZooError(Exception):
    """Base class of errors zoo reports to users (no traceback needed).

    Each class declares how it is reported: the `zoo` command's exit status, the REST API's HTTP status and the
    error body's `type` (one word of webapp/errors.py's ERROR_TYPES). Handlers read these; none switches on classes.
    """

    exit_code = 2
    http_status = 400
    error_type = "bad_request"


class UsageError(ZooError):
    """A request that cannot be answered as asked (bad argument, k past the cap, unknown method)."""


class NotFoundError(ZooError):
    """The adapter, space or embedder asked for does not exist."""

    http_status = 404
    error_type = "not_found"


class SpaceNotFoundError(NotFoundError):
    """An embedding space asked for by name that the zoo does not have; the message lists the ones it has."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        self.known = known
        super().__init__(f"no embedding space {name!r}; spaces: {', '.join(known) or 'none (run `zoo embed`)'}")


class NotReadyError(ZooError):
    """The zoo lacks what the request needs yet (embeddings, a trained W2T, an index): the message says what to run."""

    http_status = 409
    error_type = "not_ready"


class StorageError(ZooError):
    """Stored data a request needs is missing or unreadable (a blob): `zoo check` reports it; ingest the adapter again."""

    http_status = 500
    error_type = "storage"  # not `internal`: the code is sound, a stored file is not


class InputError(ZooError):
    """A file or directory that cannot be read as an adapter; nothing is stored for it."""

    http_status = 422
    error_type = "unprocessable"  # not `validation`, which is a request's fields

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")
