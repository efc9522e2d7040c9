"""Who may call what: every route declares the scope it needs with `needs(scope)` (read, write, admin; or it is one of
webapp.security's OPEN_ENDPOINTS), and `check_scope`, before every request, holds the request's token to it.

A program sends `Authorization: Bearer <token>` (made with `zoo token create NAME --scope SCOPE`). A browser signs in
at /sign-in and keeps its token in an HttpOnly, SameSite=Lax cookie (TOKEN_COOKIE) together with the scope the cookie
may use: read, unless the user asked for more at sign-in (never more than the token's own). A write with the cookie
must also come from a page of this site (Sec-Fetch-Site says so), never from another site's form.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

from apiflask import HTTPTokenAuth
from flask import Flask, g, request

from webapp.context import zoo_context
from zoo.store.session import write_transaction
from zoo.store.tokens import SCOPES, LiveToken, Scope, covers, find_token, parse_scope, stamp_use

F = TypeVar("F", bound=Callable[..., object])

#: the bearer scheme the OpenAPI document lists for the routes that always need a token (write and admin)
token_auth = HTTPTokenAuth(scheme="Bearer", description="A token from `zoo token create NAME --scope SCOPE`")

#: the cookie a signed-in browser sends its token in, as `<scope>:<token>` (the scope the cookie may use)
TOKEN_COOKIE = "zoo_token"
#: the header a program sends its token in
BEARER = "Authorization: Bearer <token>"
#: what every 401 tells a program to do
SEND_TOKEN = f"send {BEARER} (`zoo token create NAME` makes one)"
#: the attribute `needs` sets on a view
SCOPE_ATTRIBUTE = "zoo_scope"


def needs(scope: Scope) -> Callable[[F], F]:
    """Declare the scope a route needs (put it right under the route's decorator). `read` routes need a token only
    under ZOO_READ_TOKEN_REQUIRED; `write` and `admin` ones always, and the OpenAPI document lists their scope."""
    parse_scope(scope)

    def declare(view: F) -> F:
        setattr(view, SCOPE_ATTRIBUTE, scope)
        if scope != "read":  # the document's security requirement, with the scope as its role (apiflask's own key)
            spec = view.__dict__.setdefault("_spec", {})
            spec.update(auth=token_auth, roles=[scope])
        return view

    return declare


def declared_scope(app: Flask, endpoint: str) -> Scope | None:
    """The scope `endpoint`'s view declared with `needs`; None when it declared none."""
    return getattr(app.view_functions[endpoint], SCOPE_ATTRIBUTE, None)


def undeclared_endpoints(app: Flask, open_endpoints: frozenset[str]) -> list[str]:
    """The app's endpoints that neither declare a scope nor are open: each is a route nobody decided who may call."""
    return sorted(e for e in app.view_functions if e not in open_endpoints and declared_scope(app, e) is None)


@dataclass(frozen=True)
class Caller:
    """The token a request came with, how it came, and the scope it may use here (a cookie's may be less)."""

    token: LiveToken
    scope: Scope
    by_cookie: bool


class ScopeRefusal(Exception):
    """A request whose token is missing, unknown, or of too small a scope: `status` 401 or 403, and what to send."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def live_token(token: str) -> LiveToken | None:
    """The live token `token` is, read in a session of its own; its last use stamped in a write transaction only when
    due (at most once a minute), so that reads stay reads. Not in the request's session: a read there would begin the
    transaction a write route then writes in, and SQLite refuses that write once another writer (the stamp, a job)
    has committed since the read."""
    sessions = zoo_context().sessions
    with sessions() as session:
        found = find_token(session, token)
    now = datetime.now(UTC)
    if found is not None and found.stamp_due(now):
        with write_transaction(sessions) as session:
            stamp_use(session, found, now)
    return found


def bearer_token() -> str | None:
    """The token in the request's `Authorization: Bearer` header, if any."""
    scheme, _, token = (request.headers.get("Authorization") or "").partition(" ")
    return (token.strip() or None) if scheme.lower() == "bearer" else None


def cookie_value(token: str, scope: Scope) -> str:
    return f"{scope}:{token}"


def cookie_token() -> tuple[str, Scope] | None:
    """The sign-in cookie's token and the scope it may use (read for a cookie that names none or an unknown one)."""
    value = request.cookies.get(TOKEN_COOKIE) or ""
    scope, _, token = value.rpartition(":")
    if not token:
        return None
    return token, parse_scope(scope) if scope in SCOPES else "read"


def request_token() -> str | None:
    """The token the request carries: the Authorization header's, else the sign-in cookie's."""
    cookie = cookie_token()
    return bearer_token() or (cookie[0] if cookie else None)


def token_problem(token: str | None, needs: str = "this request needs a token") -> str:
    """Why a request's token was refused and what to send: none came (`needs`), or the one that came is unknown."""
    if token:
        return f"that token is unknown or revoked: {SEND_TOKEN}"
    return f"{needs}: {SEND_TOKEN}"


def from_this_site() -> bool:
    """Whether the browser says the request comes from a page of this site (Sec-Fetch-Site, which every current browser
    sends; the Host header is not consulted, being the client's to set): a write with the cookie must."""
    return request.headers.get("Sec-Fetch-Site") == "same-origin"


def caller() -> Caller | None:
    """The request's live token (the header's, else the cookie's) and the scope it may use; None when none came.
    ScopeRefusal (401) when one came and is unknown or revoked."""
    header = bearer_token()
    cookie = None if header else cookie_token()
    token = header or (cookie[0] if cookie else None)
    if token is None:
        return None
    found = live_token(token)
    if found is None:
        raise ScopeRefusal(401, token_problem(token))
    if cookie is None:
        return Caller(found, found.scope, by_cookie=False)
    usable = min(found.scope, cookie[1], key=SCOPES.index)
    return Caller(found, usable, by_cookie=True)


def check_scope(scope: Scope, read_token_required: bool) -> None:
    """Hold the request to `scope`; the caller is kept for the view (`current_token`). ScopeRefusal otherwise: 401 for
    no token or an unknown one, 403 naming the scope needed and the token's."""
    if scope == "read" and not read_token_required:
        return  # open reads: a token that came (a stale cookie) is not even looked at
    found = caller()
    g.zoo_caller = found
    if found is None:
        message = token_problem(None, "this server needs a token for reads too" if scope == "read" else "this request needs a token")
        raise ScopeRefusal(401, message)
    if covers(found.scope, scope):
        if found.by_cookie and scope != "read" and not from_this_site():
            raise ScopeRefusal(403, f"a write with the sign-in cookie must come from this site's pages; a program sends {BEARER}")
        return
    if found.by_cookie and covers(found.token.scope, scope):
        raise ScopeRefusal(
            403, f"this needs scope {scope}, and the sign-in cookie only reads: send {BEARER}, or sign in again allowing writes"
        )
    raise ScopeRefusal(
        403,
        f"this needs a token of scope {scope}; this one ({found.token.name}) has scope {found.token.scope}: "
        f"`zoo token create NAME --scope {scope}` makes one",
    )


def current_token() -> LiveToken:
    """The token of a request to a write or admin route (check_scope found it before the view ran)."""
    found: Caller | None = g.get("zoo_caller")
    if found is None:
        raise RuntimeError("current_token() outside a route that needs a token")
    return found.token
