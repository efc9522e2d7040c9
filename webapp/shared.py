"""What both blueprints do with a request: the adapter an id names (404 otherwise), ids out of the key's range,
a space's filters, uploads laid out and searched under the time limit, and text the databases cannot hold (NUL
characters, JSON nested too deep) refused before any view runs."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from flask import request

from embed.serving import resources
from embed.serving.refs import UploadedFile
from webapp import schemas
from webapp.context import db, zoo_context
from zoo.errors import NotFoundError, UsageError
from zoo.sources.upload import Upload, materialize
from zoo.store import repository
from zoo.store.models import Adapter
from zoo.store.session import Session, read_snapshot

T = TypeVar("T")


def with_session(fn: Callable[[Session], T]) -> Callable[[], T]:
    """fn with a session of its own reading one snapshot (for reads run in the app's pool, outside the request)."""
    sessions = zoo_context().sessions

    def run() -> T:
        with sessions() as session:
            return fn(read_snapshot(session))

    return run


def limited_upload(files: list, fn: Callable[[Session, UploadedFile], T]) -> T:
    """fn(session, upload) on the uploaded files laid out in a temporary directory, under the time limit."""
    ctx = zoo_context()
    uploads = [Upload(f.filename or "upload", f.stream) for f in files]
    uploads_dir = ctx.settings.data_dir / "uploads"  # requests touch no directory but the data dir and the import root
    uploads_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="query-", dir=uploads_dir) as tmp:
        upload = UploadedFile(materialize(uploads, Path(tmp), ctx.web.max_upload_bytes))
        return ctx.limited(with_session(lambda session: fn(session, upload)))


def ids_in_range(_endpoint: str | None, values: dict[str, object] | None) -> None:
    """A path id past what an SQL INTEGER key holds names nothing: 404, not an overflow in the database driver."""
    for key in ("adapter_id", "job_id"):
        value = (values or {}).get(key)
        if isinstance(value, int) and value > schemas.MAX_ID:
            raise NotFoundError(f"no {key.removesuffix('_id')} with id {value}")


def get_adapter(adapter_id: int, with_modules: bool = False) -> Adapter:
    adapter = repository.get_adapter(db(), adapter_id, with_modules=with_modules)
    if adapter is None:
        raise NotFoundError(f"no adapter with id {adapter_id}")
    return adapter


def space_filters(session: Session, space: str | None, filters: dict[str, str]) -> dict[str, str]:
    """The filters that keep a space's adapters (those of its base model) besides `filters`; 404 for an unknown
    space (naming the known ones), 400 when a base_model filter names another base."""
    if not space:
        return filters
    base = resources.resolve_space(session, space).base_model
    if filters.get("base_model", base) != base:
        raise UsageError(f"filter base_model={filters['base_model']} is not the base model of space {space} ({base})")
    return {**filters, "base_model": base}


def refuse_nul() -> None:
    """Text holding NUL characters (path, query, form, file names, JSON) is refused alike on both databases:
    PostgreSQL cannot store it, and a query with it fails in the driver."""
    fields = [*(request.view_args or {}).items(), *request.args.items(multi=True), *request.form.items(multi=True)]
    texts = [t for pair in fields for t in pair] + [f.filename for _, f in request.files.items(multi=True)]
    if any(isinstance(t, str) and "\x00" in t for t in texts) or (request.is_json and _holds_nul(_json_body())):
        raise UsageError("text in a request may not hold NUL characters")


#: JSON bodies nest no deeper than this (the deepest the API reads is 3: an object of lists or objects)
MAX_JSON_DEPTH = 32


def refuse_invalid_json(send: str) -> None:
    """A JSON body that does not parse is a 400 saying why and where (the decoder's line and column) and what to
    send, in the API's error shape (not Werkzeug's page about the browser or proxy); an empty one says it is empty."""
    if _json_body() is not None:
        return
    data = request.get_data(cache=True)
    problem = _json_error(data) if data.strip() else "the JSON body is empty"
    if problem:
        raise UsageError(f"{problem}: send {send}")


def _json_error(data: bytes) -> str | None:
    """Why `data` is not JSON, and where; None where it is (the JSON `null`)."""
    try:
        json.loads(data)
    except json.JSONDecodeError as exc:
        return f"the body is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
    except UnicodeDecodeError as exc:
        return f"the body is not valid JSON (not UTF-8 at byte {exc.start})"
    except ValueError:  # json's bare ValueError: an integer Python will not read (sys.get_int_max_str_digits)
        return "the body holds an integer of more than 4,300 digits"
    return None


def _json_body() -> object:
    """The request's JSON (None if it is not JSON), parsed once for the view too; nested past the parser's recursion
    limit or past MAX_JSON_DEPTH is a 400."""
    try:
        return request.get_json(silent=True)
    except RecursionError:
        raise UsageError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None


def _holds_nul(value: object) -> bool:
    """Whether any string (key or value) in the JSON value holds NUL; walked with a stack, not recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return True
        elif isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise UsageError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False
