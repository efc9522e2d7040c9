"""One error shape for the API, one error page for people.

API errors are `{"error": {"status", "type", "message", "detail"}}` with the HTTP status:
zoo's own errors declare theirs on the class (`http_status`, `error_type`: 400 usage, 404 not found, 409 not
ready, 422 unreadable adapter, 500 storage), request validation is 422, too large 413, wrong type 415, auth 401/403. `type` is one
word of ERROR_TYPES (snake_case; the OpenAPI document's Error schema lists them); pages show its title.
"""

from __future__ import annotations

from typing import Any, TypedDict

from apiflask import APIFlask, HTTPError
from flask import Response, jsonify, render_template, request
from werkzeug.exceptions import HTTPException

from zoo.errors import ZooError

API_PREFIX = "/api/"

#: every error's `type`, with its usual status and the title its page shows: one vocabulary for zoo's own errors,
#: Flask's and apiflask's, gunicorn's (webapp/serve.py) and the proxy's in front (429, 502, 504)
ERROR_TYPES: dict[str, tuple[int, str]] = {
    "bad_request": (400, "Bad request"),
    "unauthorized": (401, "Token needed"),
    "forbidden": (403, "Forbidden"),
    "not_found": (404, "Not found"),
    "method_not_allowed": (405, "Method not allowed"),
    "not_ready": (409, "Not ready yet"),
    "too_large": (413, "Too large"),
    "uri_too_long": (414, "Address too long"),
    "unsupported_media_type": (415, "Unsupported media type"),
    "validation": (422, "Invalid request"),
    "unprocessable": (422, "Not a readable adapter"),
    "too_many_requests": (429, "Too many requests"),
    "headers_too_large": (431, "Headers too large"),
    "internal": (500, "Server error"),
    "storage": (500, "Stored data missing"),
    "not_implemented": (501, "Not implemented"),
    "bad_gateway": (502, "Bad gateway"),
    "unavailable": (503, "Took too long"),
    "gateway_timeout": (504, "Gateway timeout"),
}
_BY_STATUS = {status: kind for kind, (status, _) in reversed(ERROR_TYPES.items())}  # the first type listed for a status


class ErrorFields(TypedDict):
    status: int
    type: str  # one of ERROR_TYPES
    message: str
    detail: object  # validation errors by field, or None


class ErrorBody(TypedDict):
    """Every error the API answers."""

    error: ErrorFields


def error_body(status: int, kind: str, message: str, detail: Any = None) -> ErrorBody:
    return {"error": {"status": status, "type": kind, "message": message, "detail": detail}}


def kind_of(status: int) -> str:
    """The error type for an HTTP status (the first listed for it; else bad_request or internal by its class)."""
    return _BY_STATUS.get(status) or ("bad_request" if status < 500 else "internal")


def _respond(status: int, kind: str, message: str, detail: Any = None, headers: dict[str, str] | None = None) -> Response | tuple:
    if request.path.startswith(API_PREFIX):
        response = jsonify(error_body(status, kind, message, detail))
        response.status_code = status
        response.headers.update(headers or {})
        return response
    heading = ERROR_TYPES[kind][1]  # "Not found", never a class name
    return render_template("error.html", status=status, heading=heading, message=message), status, headers or {}


def register(app: APIFlask) -> None:
    @app.error_processor
    def _apiflask_error(error: HTTPError) -> tuple[ErrorBody, int, Any]:  # validation and abort() in API views
        kind = "validation" if error.status_code == 422 else kind_of(error.status_code)
        return error_body(error.status_code, kind, str(error.message), error.detail or None), error.status_code, error.headers

    @app.errorhandler(ZooError)
    def _zoo_error(exc: ZooError) -> Response | tuple:
        return _respond(exc.http_status, exc.error_type, str(exc))  # each class declares both

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Response | tuple:
        status = exc.code or 500
        allow = getattr(exc, "valid_methods", None)
        return _respond(status, kind_of(status), exc.description or exc.name, headers={"Allow": ", ".join(allow)} if allow else None)
