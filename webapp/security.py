"""What every request and response passes through, in one place: each route's declared scope held to the request's
token (webapp/auth.py), the security headers, and no server path in a response body.

Scopes: every endpoint but OPEN_ENDPOINTS declares with `needs` the scope it needs, and `require_scope` checks it before
any view or blueprint hook runs: `read` needs a live token only under ZOO_READ_TOKEN_REQUIRED (the header's or the
sign-in cookie's), `write` and `admin` always, of that scope or more (401 without one, 403 naming the scope needed). An
app whose routes do not all declare one does not start.
"""

from __future__ import annotations

import functools
import html
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from apiflask import APIFlask
from flask import Response, current_app, jsonify, render_template, request

from webapp.auth import TOKEN_COOKIE as TOKEN_COOKIE  # the cookie a signed-in browser sends its token in
from webapp.auth import ScopeRefusal, check_scope, declared_scope, request_token, undeclared_endpoints
from webapp.context import zoo_context
from webapp.errors import API_PREFIX, error_body, kind_of

if TYPE_CHECKING:
    import socket

#: endpoints anyone may call when reads need a token: liveness, the API's description and its docs page (the
#: document only, no data), static files, and signing in
OPEN_ENDPOINTS = frozenset({"api.health", "openapi.spec", "ui.api_docs_page", "static", "ui.sign_in", "ui.sign_out"})

#: on every response. Scripts and styles only from this site's files (no inline script or style, no eval), images
#: also as data: URIs (Swagger UI's icons), no plugins, no framing, forms post only here
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; font-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
}


def require_scope() -> Response | tuple | None:
    """Before every request: the endpoint's declared scope held to the request's token (module doc); a refusal is
    JSON under /api/, else a page (a 401 page to sign in on). A URL no route matches goes on to its 404 or 405."""
    endpoint = request.endpoint
    if endpoint is None or endpoint in OPEN_ENDPOINTS:
        return None
    scope = declared_scope(current_app, endpoint) or "admin"  # create_app refuses an undeclared route; never open by mistake
    try:
        check_scope(scope, zoo_context().web.read_token_required)
    except ScopeRefusal as refusal:
        return refused(refusal)
    return None


def refused(refusal: ScopeRefusal) -> Response | tuple:
    """A request refused for its token: the error shape under /api/; elsewhere a page to sign in on (401) or the error
    page (403)."""
    headers = {"WWW-Authenticate": 'Bearer realm="zoo"'} if refusal.status == 401 else {}
    if request.path.startswith(API_PREFIX):
        response = jsonify(error_body(refusal.status, kind_of(refusal.status), refusal.message))
        response.status_code = refusal.status
        response.headers.update(headers)
        return response
    if refusal.status == 403:
        return render_template("error.html", status=403, heading="Forbidden", message=refusal.message), 403
    problem = "that token is unknown or revoked" if request_token() else None
    return render_template("sign_in.html", problem=problem, next=local_path(request.full_path)), 401, headers


def check_declared(app: APIFlask) -> None:
    """Refuse to start an app with a route that neither declares its scope nor is open (create_app calls it once every
    blueprint is registered)."""
    missing = undeclared_endpoints(app, OPEN_ENDPOINTS)
    if missing:
        raise RuntimeError(f"routes without a declared scope (webapp.auth.needs): {', '.join(missing)}")


def local_path(target: str | None) -> str:
    """`target` if it is a path on this site (what /sign-in may send a browser back to), else "/". Control characters and
    spaces are refused too: a browser drops a tab or a newline inside a URL, so `/<TAB>/evil.example` is `//evil.example`,
    and CR or LF cannot go in a Location header."""
    if not target or not re.fullmatch(r"/(?![/\\])[^\\]*", target) or " " in target or not target.isprintable():
        return "/"
    return target.removesuffix("?")


def security_headers(response: Response) -> Response:
    """After every request (pages, JSON, files, errors): the security headers, unless a view set its own."""
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    return response


@dataclass(frozen=True)
class ServerPaths:
    """How a body may name the data dir and the import root (each as configured and resolved, as JSON and HTML
    write them), and the variable that names each in a response."""

    placeholders: dict[str, str]
    needles: tuple[bytes, ...]
    pattern: re.Pattern[str]

    @classmethod
    @functools.lru_cache(maxsize=8)
    def of(cls, data_dir: str, import_root: str | None) -> ServerPaths:
        roots = {"$ZOO_DATA_DIR": data_dir, **({"$ZOO_IMPORT_ROOT": import_root} if import_root else {})}
        placeholders = {
            form: name
            for name, root in roots.items()
            for path in (root, str(Path(root).resolve()))
            for form in (path, json.dumps(path)[1:-1], html.escape(path))
        }
        # an upload's temporary directory (data dir/uploads/<one directory>/) goes whole, leaving the upload's file
        # name; otherwise a root becomes its variable. Longest first: the data dir may lie inside the import root
        forms = sorted(placeholders, key=len, reverse=True)
        uploads = "|".join(re.escape(f) for f in forms if placeholders[f] == "$ZOO_DATA_DIR")
        roots_re = "|".join(re.escape(f) for f in forms)
        pattern = re.compile(rf"(?P<upload>(?:{uploads})/uploads/[A-Za-z0-9_.-]+/)|(?P<root>{roots_re})(?![A-Za-z0-9_.-])")
        return cls(placeholders, tuple({f.encode() for f in forms}), pattern)

    def hide(self, text: str) -> str:
        return self.pattern.sub(lambda m: "" if m.group("upload") else self.placeholders[m.group("root")], text)


def server_paths() -> ServerPaths:
    ctx = zoo_context()
    return ServerPaths.of(str(ctx.settings.data_dir), str(ctx.web.import_root) if ctx.web.import_root else None)


def public_text(text: str) -> str:
    """`text` without the server's paths: an upload's temporary directory dropped (its file name stays), the data dir
    and the import root named by their variables ($ZOO_DATA_DIR/..., $ZOO_IMPORT_ROOT/...)."""
    return server_paths().hide(text)


def hide_server_paths(response: Response) -> Response:
    """After every request: a JSON or HTML body that names the data dir or the import root (an upload's error, the
    `query` of an upload search, a job item's source) names the upload's file or the variable instead."""
    if response.direct_passthrough or response.is_streamed or response.mimetype not in ("application/json", "text/html"):
        return response
    paths = server_paths()
    body = response.get_data()
    if any(n in body for n in paths.needles):
        response.set_data(paths.hide(body.decode()))
    return response


def register(app: APIFlask) -> None:
    app.before_request(require_scope)  # app hooks run before the blueprints' (refuse_nul, body types)
    app.after_request(hide_server_paths)
    app.after_request(security_headers)


def write_json_error(sock: socket.socket, status_int: int, reason: str, mesg: str) -> None:
    """gunicorn's util.write_error in the error shape: what gunicorn refuses before the app sees a request (a request
    line past limit_request_line is 414, headers past their limits 431, a malformed request 400) as JSON, with the
    security headers, whatever the path (gunicorn has not parsed it)."""
    from gunicorn import util

    from webapp.errors import kind_of

    body = json.dumps(error_body(status_int, kind_of(status_int), mesg or reason)).encode()
    head = [f"HTTP/1.1 {status_int} {reason}", "Connection: close", "Content-Type: application/json", f"Content-Length: {len(body)}"]
    head += [f"{name}: {value}" for name, value in SECURITY_HEADERS.items()]
    util.write_nonblock(sock, ("\r\n".join(head) + "\r\n\r\n").encode("latin1") + body)


def gunicorn_errors_as_json() -> None:
    """Make gunicorn write its own error answers with write_json_error (`zoo serve` calls this before its workers
    start; gunicorn's workers call util.write_error for every request they refuse)."""
    from gunicorn import util

    util.write_error = write_json_error
