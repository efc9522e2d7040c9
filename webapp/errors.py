"""One error shape for the API, one error page for people.

API errors are `{"error": {"status", "type", "message", "detail"}}` with the HTTP status:
zoo's own errors carry theirs (400 usage, 404 not found, 409 not ready, 422 unreadable adapter,
500 storage), request validation is 422, too large 413, wrong type 415, auth 401/403.
"""

from __future__ import annotations

from typing import Any

from apiflask import APIFlask, HTTPError
from flask import Response, jsonify, render_template, request
from werkzeug.exceptions import HTTPException
from werkzeug.http import HTTP_STATUS_CODES

from zoo.errors import InputError, ZooError

API_PREFIX = "/api/"


def error_body(status: int, kind: str, message: str, detail: Any = None) -> dict[str, object]:
    return {"error": {"status": status, "type": kind, "message": message, "detail": detail}}


def status_of(exc: ZooError) -> int:
    from zoo.sources.upload import UploadTooLarge

    if isinstance(exc, UploadTooLarge):
        return 413
    if isinstance(exc, InputError):
        return 422  # a file that cannot be read as an adapter
    return exc.http_status


def _respond(status: int, kind: str, message: str, detail: Any = None, headers: dict[str, str] | None = None) -> Response | tuple:
    if request.path.startswith(API_PREFIX):
        response = jsonify(error_body(status, kind, message, detail))
        response.status_code = status
        response.headers.update(headers or {})
        return response
    heading = HTTP_STATUS_CODES.get(status, "Error").capitalize()  # "Not found", not the exception's class name
    return render_template("error.html", status=status, heading=heading, message=message), status, headers or {}


def register(app: APIFlask) -> None:
    @app.error_processor
    def _apiflask_error(error: HTTPError) -> tuple[dict[str, object], int, Any]:  # validation and abort() in API views
        kind = "validation" if error.status_code == 422 else _kind(error.status_code)
        return error_body(error.status_code, kind, str(error.message), error.detail or None), error.status_code, error.headers

    @app.errorhandler(ZooError)
    def _zoo_error(exc: ZooError):  # type: ignore[no-untyped-def]
        status = status_of(exc)
        return _respond(status, type(exc).__name__, str(exc))

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):  # type: ignore[no-untyped-def]
        status = exc.code or 500
        allow = getattr(exc, "valid_methods", None)
        return _respond(status, _kind(status), exc.description or exc.name, headers={"Allow": ", ".join(allow)} if allow else None)


def _kind(status: int) -> str:
    return {
        400: "bad_request",
        401: "unauthorized",
        403: "forbidden",
        404: "not_found",
        405: "method_not_allowed",
        409: "not_ready",
        413: "too_large",
        415: "unsupported_media_type",
        422: "unprocessable",
        503: "unavailable",
    }.get(status, "error")
