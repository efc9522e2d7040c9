"""The web app: `create_app()` with a `ui` blueprint (HTML pages) and an `api` blueprint (`/api/v1`,
JSON, OpenAPI at `/api/v1/openapi.json`, docs at `/api/v1/docs`). Run it with `zoo serve`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from apiflask import APIFlask

from zoo import __version__
from zoo.config import Settings
from zoo.store.session import require_schema


def create_app(config: Mapping[str, object] | None = None) -> APIFlask:
    """The app for one database and data dir (config keys ZOO_DATABASE_URL, ZOO_DATA_DIR, ZOO_IMPORT_ROOT,
    ZOO_MAX_UPLOAD_BYTES, ZOO_READ_TOKEN_REQUIRED, ZOO_TIME_LIMIT_S; else the environment)."""
    from webapp import errors, metrics, request_ids, schemas, security
    from webapp.api import api
    from webapp.context import WebConfig, ZooContext, close_session
    from webapp.ui import ui

    config = dict(config or {})
    url, data_dir = config.get("ZOO_DATABASE_URL"), config.get("ZOO_DATA_DIR")
    if not isinstance(url, str | None) or not isinstance(data_dir, str | Path | None):
        raise TypeError("ZOO_DATABASE_URL is a str and ZOO_DATA_DIR a str or a Path")
    settings = Settings.load(url, data_dir)
    require_schema(settings.database_url)
    web = WebConfig.from_env(config)
    # the docs page is the ui blueprint's (webapp/templates/api_docs.html: the site's header, a phone layout)
    app = APIFlask(__name__, title="zoo", version=__version__, spec_path="/api/v1/openapi.json", docs_path=None)
    app.config.update(
        MAX_CONTENT_LENGTH=web.max_upload_bytes + (1 << 20),  # the multipart envelope around the files
        JSON_SORT_KEYS=False,
        # the document's server is this site, relative: never built from a request's Host header, since the document is
        # made once and kept for every later request
        SERVERS=[{"url": "/"}],
        HTTP_ERROR_SCHEMA=schemas.Error,  # the one error shape (webapp/errors.py) in the OpenAPI document
        VALIDATION_ERROR_SCHEMA=schemas.Error,
        **{k: v for k, v in config.items() if not k.startswith("ZOO_")},
    )
    app.extensions["zoo"] = ZooContext.open(settings, web)
    app.teardown_appcontext(close_session)
    errors.register(app)
    security.register(app)  # read tokens, security headers, no server path in a response
    metrics.register(app)  # GET /metrics, each request timed
    request_ids.register(app)  # each request's id: in its response, its log lines and the jobs it makes
    app.register_blueprint(api)
    app.register_blueprint(ui)
    security.check_declared(app)  # every route declares the scope it needs, or is open: else the app does not start
    return app
