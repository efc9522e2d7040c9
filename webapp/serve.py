"""`zoo serve`: the web app under gunicorn (one query engine per worker process, threads within)."""

from __future__ import annotations

from typing import Any

from gunicorn.app.base import BaseApplication

from zoo.config import Settings


class ZooServer(BaseApplication):  # type: ignore[misc]
    def __init__(self, settings: Settings, options: dict[str, Any]) -> None:
        self.settings = settings
        self.options = options
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self):  # type: ignore[no-untyped-def]
        from webapp import create_app

        return create_app({"ZOO_DATABASE_URL": self.settings.database_url, "ZOO_DATA_DIR": str(self.settings.data_dir)})


def serve(settings: Settings, host: str, port: int, workers: int, threads: int, timeout: int = 120) -> None:
    """Serve until interrupted. Each worker loads the app (and its engine) itself."""
    options = {
        "bind": f"{host}:{port}",
        "workers": workers,
        "threads": threads,
        "worker_class": "gthread",
        "timeout": timeout,
        "accesslog": "-",
        "errorlog": "-",
        "proc_name": "zoo-serve",
    }
    ZooServer(settings, options).run()
