"""Each request's id: from its X-Request-ID header where ZOO_TRUST_REQUEST_ID says a proxy in front sets it (nginx's
$request_id, deploy/nginx.conf; a client's own header is replaced there, never passed on), else a new one. It is
returned in the response's X-Request-ID, carried by every log record made while the request runs (zoo/logs.py), and
stored with a job the request makes, so that its items' log lines in `zoo worker` carry it too.

Under ZOO_LOG_FORMAT=json the app logs each request itself as one JSON line (method, route, path, status, seconds,
request id), in place of gunicorn's access log."""

from __future__ import annotations

import logging
import time

from apiflask import APIFlask
from flask import Response, g, request

from zoo import config, logs

HEADER = "X-Request-ID"

log = logging.getLogger("zoo.request")


def current() -> str | None:
    """The id of the request being served (None outside one)."""
    return logs.REQUEST_ID.get()


def begin() -> None:
    """Before every request: its id, trusted from the header only where configured, and valid; else a new one."""
    given = request.headers.get(HEADER) if config.TRUST_REQUEST_ID.get() else None
    request_id = logs.valid_request_id(given) or logs.new_request_id()
    g.zoo_request_id = request_id
    g.zoo_request_start = time.perf_counter()
    g.zoo_request_token = logs.REQUEST_ID.set(request_id)


def finish(response: Response) -> Response:
    """After every request: its id in the response, and its line in the JSON log."""
    request_id = g.get("zoo_request_id")
    if request_id is None:
        return response
    response.headers[HEADER] = request_id
    if logs.json_logs():
        route = request.url_rule.rule if request.url_rule is not None else None
        seconds = round(time.perf_counter() - g.zoo_request_start, 6)
        fields = {"method": request.method, "route": route, "path": request.path, "status": response.status_code, "seconds": seconds}
        log.info("%s %s %d", request.method, request.path, response.status_code, extra=fields)
    return response


def end(_exc: BaseException | None = None) -> None:
    """When the request is torn down: records made later in this thread carry no id."""
    token = g.pop("zoo_request_token", None)
    if token is not None:
        logs.REQUEST_ID.reset(token)


def register(app: APIFlask) -> None:
    """The hooks, before the app's others: a refused request has its id too."""
    app.before_request_funcs.setdefault(None, []).insert(0, begin)
    app.after_request(finish)
    app.teardown_request(end)
    logs.configure()
