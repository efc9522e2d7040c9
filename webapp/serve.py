"""`zoo serve`: the web app under gunicorn (one query engine per worker process, threads within).

Slow clients. gunicorn's gthread worker hands a connection to a thread as soon as its first bytes arrive, and
that thread then blocks until the request's headers are complete: 8 clients dripping their headers held every
thread of 2 workers × 4 threads and the service answered nothing (issue 30). `ZooThreadWorker` gives each
request a deadline for its headers (ZOO_HEADER_TIMEOUT_S, default 5 s in all, however the bytes trickle) and
for its body (ZOO_BODY_TIMEOUT_S, default 120 s), and every socket read or write a timeout
(ZOO_IO_TIMEOUT_S, default 30 s); past one the connection is closed and its thread is free. With 32 threads per
worker (the default), a few dozen slow clients leave threads for everyone else (measured in docs/results.md,
issue 30). Threads waiting on a socket cost no CPU; expensive calls run in the app's bounded pool
(webapp/context.py), not in these threads. Behind a buffering proxy (deploy/nginx.conf) no slow client reaches
gunicorn at all.
"""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any

from gunicorn.app.base import BaseApplication
from gunicorn.http.errors import NoMoreData
from gunicorn.workers.gthread import TConn, ThreadWorker

from zoo import config
from zoo.config import Settings

if TYPE_CHECKING:
    from apiflask import APIFlask

#: threads per worker process (`zoo serve --threads`)
DEFAULT_THREADS = 32
#: seconds a kept-alive connection may idle between requests
KEEPALIVE_S = 2


class _DeadlineSocket:
    """The socket a connection's request parser reads from, each read bounded by the time left to the
    connection's deadline (headers, then body) and by the I/O timeout."""

    def __init__(self, sock: socket.socket, conn: ZooConn) -> None:
        self._sock, self._conn = sock, conn

    def recv(self, size: int) -> bytes:
        left = self._conn.deadline - time.monotonic()
        if left > 0:
            self._sock.settimeout(min(left, self._conn.io_timeout))
            try:
                return self._sock.recv(size)
            except TimeoutError:
                pass
        # gunicorn closes the connection quietly (a client gone, as far as it knows), and at once: a graceful
        # close lingers up to 2 s draining what the client still sends, in the worker's main thread
        self._conn.timed_out = True
        raise NoMoreData(b"")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class ZooConn(TConn):
    header_timeout = config.HEADER_TIMEOUT_S.default
    body_timeout = config.BODY_TIMEOUT_S.default
    io_timeout = config.IO_TIMEOUT_S.default
    deadline = float("inf")
    timed_out = False

    def close(self, graceful: bool = False) -> None:
        super().close(graceful=graceful and not self.timed_out)

    def init(self) -> None:
        first = not self.initialized
        super().init()
        if first and self.parser is not None and hasattr(self.parser, "unreader") and hasattr(self.parser.unreader, "sock"):
            self.parser.unreader.sock = _DeadlineSocket(self.sock, self)


class ZooThreadWorker(ThreadWorker):
    """gthread with a deadline for each request's headers and body and a timeout on each socket operation."""

    def init_process(self) -> None:
        ZooConn.header_timeout = config.HEADER_TIMEOUT_S.get()
        ZooConn.body_timeout = config.BODY_TIMEOUT_S.get()
        ZooConn.io_timeout = config.IO_TIMEOUT_S.get()
        super().init_process()

    def accept(self, listener: socket.socket) -> None:
        import errno

        try:
            client, addr = listener.accept()
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        client.setblocking(True)
        self.enqueue_req(ZooConn(self.cfg, client, addr, listener.getsockname()))

    def handle(self, conn: TConn) -> Any:
        assert isinstance(conn, ZooConn)  # made by accept
        conn.deadline = time.monotonic() + conn.header_timeout  # the headers of the request this connection sends now
        return super().handle(conn)

    def handle_request(self, req: Any, conn: TConn) -> Any:
        assert isinstance(conn, ZooConn)  # made by accept
        conn.deadline = time.monotonic() + conn.body_timeout
        conn.sock.settimeout(conn.io_timeout)  # writes to a client that does not read
        try:
            return super().handle_request(req, conn)
        finally:
            conn.deadline = float("inf")


class ZooServer(BaseApplication):
    def __init__(self, settings: Settings, options: dict[str, Any]) -> None:
        self.settings = settings
        self.options = options
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)

    # the app is a WSGI application: Flask types its environ as a dict, gunicorn's stubs as any MutableMapping
    def load(self) -> APIFlask:  # type: ignore[override]
        from webapp import create_app

        return create_app({"ZOO_DATABASE_URL": self.settings.database_url, "ZOO_DATA_DIR": str(self.settings.data_dir)})


def serve(settings: Settings, host: str, port: int, workers: int, threads: int = DEFAULT_THREADS, timeout: int = 120) -> None:
    """Serve until interrupted. Each worker loads the app (and its engine) itself."""
    options = {
        "bind": f"{host}:{port}",
        "workers": workers,
        "threads": threads,
        "worker_class": config.WORKER_CLASS.get(),
        "worker_connections": config.WORKER_CONNECTIONS.get(),
        "keepalive": KEEPALIVE_S,
        "timeout": timeout,
        "accesslog": "-",
        "errorlog": "-",
        "proc_name": "zoo-serve",
    }
    from webapp.security import gunicorn_errors_as_json

    gunicorn_errors_as_json()  # what gunicorn refuses itself (414, 431, 400) in the API's JSON error shape, in every worker
    ZooServer(settings, options).run()
