"""API tokens on requests: `Authorization: Bearer <token>` (made with `zoo token create`), and the 401 that says so."""

from __future__ import annotations

from apiflask import HTTPError, HTTPTokenAuth
from flask import Response, jsonify, request

from webapp.context import zoo_context
from webapp.errors import error_body, kind_of
from zoo.store.models import ApiToken
from zoo.store.session import write_transaction
from zoo.store.tokens import verify_token

token_auth = HTTPTokenAuth(scheme="Bearer", description="A token from `zoo token create NAME`")

#: the cookie a signed-in browser sends its token in (reads only: writes need the header)
TOKEN_COOKIE = "zoo_token"
#: what every 401 tells a program to do
SEND_TOKEN = "send Authorization: Bearer <token> (`zoo token create NAME` makes one)"


@token_auth.verify_token
def stamped_token(token: str) -> ApiToken | None:
    """The live token's row, its last use stamped in a write transaction of its own: not in the request's session,
    whose read transaction SQLite cannot turn into a write once another writer (an ingest job) has committed."""
    with write_transaction(zoo_context().sessions) as session:
        return verify_token(session, token)


def bearer_token() -> str | None:
    """The token in the request's `Authorization: Bearer` header, if any."""
    scheme, _, token = (request.headers.get("Authorization") or "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def token_problem(token: str | None, needs: str = "this request needs a token") -> str:
    """Why a request's token was refused and what to send: none came (`needs`), or the one that came is unknown."""
    if token:
        return f"that token is unknown or revoked: {SEND_TOKEN}"
    return f"{needs}: {SEND_TOKEN}"


@token_auth.error_processor
def _refused(error: HTTPError) -> Response:
    """A write without a live token in the header: the error shape, saying which (none, or unknown) and what to send."""
    message = token_problem(bearer_token()) if error.status_code == 401 else str(error.message)
    if error.status_code == 401 and not bearer_token() and request.cookies.get(TOKEN_COOKIE):
        message += "; the sign-in cookie only reads"
    response = jsonify(error_body(error.status_code, kind_of(error.status_code), message))
    response.status_code = error.status_code
    return response
