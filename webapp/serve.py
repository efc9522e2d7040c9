"""`zoo serve`: the web app under gunicorn (one query engine per worker process, threads within).

Slow clients cost no thread. gunicorn's gthread worker hands a connection to a thread as soon as its first bytes
arrive, and that thread then blocks until the request's headers and body are in: 128 clients dripping their headers,
or 70 sending their bodies slowly, held every thread and health probes timed out. `ZooThreadWorker` reads each
request in its event loop first, without a thread, as a buffering proxy does: the headers (ZOO_HEADER_TIMEOUT_S,
default 5 s in all, however the bytes trickle) and then a body of declared length (ZOO_BODY_TIMEOUT_S, default
120 s; held in memory up to SPOOL_BYTES, in a temporary file past it); only a whole request goes to a thread. What
the loop does not read ahead (headers past PREREAD_HEAD_BYTES, a chunked body, a body past the upload limit) is read
in the thread under the same deadlines and a timeout per socket read or write (ZOO_IO_TIMEOUT_S, default 30 s), and
at most a quarter of the threads stream a chunked body at once (past that: 503). Expensive calls run in the app's
bounded pools (webapp/context.py), not in these threads. Behind a buffering proxy (deploy/nginx.conf) no slow client
reaches gunicorn at all.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import selectors
import socket
import tempfile
import time
from functools import partial
from typing import IO, TYPE_CHECKING, Any

from gunicorn.app.base import BaseApplication
from gunicorn.http.errors import NoMoreData
from gunicorn.workers.gthread import TConn, ThreadWorker

from zoo import config, logs, metrics
from zoo.config import Settings

if TYPE_CHECKING:
    from apiflask import APIFlask

#: threads per worker process (`zoo serve --threads`)
DEFAULT_THREADS = 32
#: seconds a kept-alive connection may idle between requests
KEEPALIVE_S = 2
#: header bytes the event loop reads ahead; longer headers are read in a thread (gunicorn refuses past ~800 KB)
PREREAD_HEAD_BYTES = 64 << 10
#: body bytes a connection read ahead holds in memory; the rest goes to a temporary file
SPOOL_BYTES = 256 << 10
#: bytes per read in the event loop
_RECV = 64 << 10


class _DeadlineSocket:
    """The socket a connection's request parser reads from: first what the event loop read ahead, then the socket,
    each read bounded by the time left to the connection's deadline (headers, then body) and by the I/O timeout."""

    def __init__(self, sock: socket.socket, conn: ZooConn) -> None:
        self._sock, self._conn = sock, conn

    def recv(self, size: int) -> bytes:
        if self._conn.preread is not None:  # what the event loop read ahead comes first
            if chunk := self._conn.preread.read(size):
                return chunk
            self._conn.preread.close()
            self._conn.preread = None
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
    #: a body longer than this is not read ahead (the app refuses it with 413 unread)
    max_body = config.MAX_UPLOAD_BYTES.default + (1 << 20)
    deadline = float("inf")
    timed_out = False
    #: what the event loop read ahead of the request a thread parses next (headers, and the body of declared length)
    preread: IO[bytes] | None = None
    #: the event loop answered `Expect: 100-continue` itself
    continued = False
    #: a thread streams this connection's chunked body
    streaming = False

    def close(self, graceful: bool = False) -> None:
        super().close(graceful=graceful and not self.timed_out)

    def init(self) -> None:
        first = not self.initialized
        super().init()
        if first and self.parser is not None and hasattr(self.parser, "unreader") and hasattr(self.parser.unreader, "sock"):
            self.parser.unreader.sock = _DeadlineSocket(self.sock, self)


def _framing(head: bytes) -> tuple[int | None, bool, bool]:
    """(Content-Length, chunked, expects 100-continue) of a request's header block; a length that is not one plain
    number is None (the thread's parser answers it)."""
    length: int | None = 0
    chunked = expect = False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            length = int(value) if value.isdigit() and length == 0 and len(value) < 19 else None
        elif name == b"transfer-encoding":
            chunked = True
        elif name == b"expect":
            expect = value == b"100-continue"
    return length, chunked, expect


def _spool(head: bytearray) -> IO[bytes]:
    """A file for what is read ahead of one request (in memory up to SPOOL_BYTES), holding `head`; the connection
    closes it once its request is parsed."""
    spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115 - it outlives this call
    spool.write(head)
    return spool


#: what a connection past the bound on chunked bodies is answered
_BUSY = json.dumps({"error": {"status": 503, "type": "unavailable", "message": "too many request bodies are streaming; try again"}})
_BUSY_RESPONSE = (
    f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(_BUSY)}\r\n"
    f"Retry-After: 5\r\nConnection: close\r\n\r\n{_BUSY}"
).encode()


class ZooThreadWorker(ThreadWorker):
    """gthread that reads each request ahead in its event loop (the module's doc), with a deadline for each request's
    headers and body and a timeout on each socket operation in the threads."""

    def init_process(self) -> None:
        ZooConn.header_timeout = config.HEADER_TIMEOUT_S.get()
        ZooConn.body_timeout = config.BODY_TIMEOUT_S.get()
        ZooConn.io_timeout = config.IO_TIMEOUT_S.get()
        ZooConn.max_body = config.MAX_UPLOAD_BYTES.get() + (1 << 20)
        self.reading: dict[ZooConn, tuple[bytearray, IO[bytes] | None, int]] = {}  # connection: (head, body, bytes left)
        self.streaming = 0
        metrics.note_resident()  # every worker in /metrics from its start, whether or not it has answered a request yet
        super().init_process()

    def accept(self, listener: socket.socket) -> None:
        try:
            client, addr = listener.accept()
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        self._read_ahead(ZooConn(self.cfg, client, addr, listener.getsockname()))

    def on_client_socket_readable(self, conn: TConn, client: socket.socket) -> None:
        """A kept-alive connection sends its next request: read it ahead too."""
        self.poller.unregister(client)
        self.keepalived_conns.remove(conn)
        assert isinstance(conn, ZooConn)  # made by accept
        self._read_ahead(conn)

    def _read_ahead(self, conn: ZooConn) -> None:
        conn.sock.setblocking(False)
        conn.deadline = time.monotonic() + conn.header_timeout
        self.reading[conn] = (bytearray(), None, 0)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_readable, conn))

    def _on_readable(self, conn: ZooConn, _sock: socket.socket) -> None:
        """Read what the connection sent (in the event loop): headers, then a body of declared length; a whole
        request goes to a thread."""
        head, body, left = self.reading[conn]
        try:
            data = conn.sock.recv(_RECV)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client is gone
            self._drop(conn)
            return
        if body is not None:
            body.write(data)
            self.reading[conn] = (head, body, left - len(data))
            if left - len(data) <= 0:
                self._dispatch(conn, body)
            return
        head += data
        end = head.find(b"\r\n\r\n")
        if end < 0:
            if len(head) > PREREAD_HEAD_BYTES:
                self._dispatch(conn, head)  # long headers: the thread reads the rest under the header deadline
            return
        length, chunked, expect = _framing(bytes(head[:end]))
        if chunked or length is None or length > conn.max_body:  # read in a thread (or refused by it unread)
            if chunked and self.streaming >= max(1, self.cfg.threads // 4):
                self._refuse(conn)
                return
            conn.streaming = chunked
            self.streaming += chunked
            self._dispatch(conn, head)
            return
        left = length - (len(head) - end - 4)
        if left <= 0:
            self._dispatch(conn, head)
            return
        spool = _spool(head)
        if expect:
            try:
                conn.sock.send(b"HTTP/1.1 100 Continue\r\n\r\n")
            except OSError:
                self._drop(conn)
                return
            conn.continued = True
        conn.deadline = time.monotonic() + conn.body_timeout
        self.reading[conn] = (head, spool, left)

    def _dispatch(self, conn: ZooConn, read: bytearray | IO[bytes]) -> None:
        self.poller.unregister(conn.sock)
        del self.reading[conn]
        spool = _spool(read) if isinstance(read, bytearray) else read
        spool.seek(0)
        conn.preread = spool
        conn.data_ready = True
        self.enqueue_req(conn)

    def _refuse(self, conn: ZooConn) -> None:
        with contextlib.suppress(OSError):
            conn.sock.send(_BUSY_RESPONSE)
        self._drop(conn)

    def _drop(self, conn: ZooConn) -> None:
        self.poller.unregister(conn.sock)
        _, body, _ = self.reading.pop(conn)
        if body is not None:
            body.close()
        self.nr_conns -= 1
        conn.close()

    def murder_pending(self) -> None:
        """Close connections past their deadline while read ahead (and gthread's pending ones)."""
        super().murder_pending()
        now = time.monotonic()
        for conn in [c for c in self.reading if c.deadline < now]:
            self._drop(conn)

    def finish_request(self, conn: TConn, fs: Any) -> None:
        assert isinstance(conn, ZooConn)  # made by accept
        if conn.streaming:
            conn.streaming = False
            self.streaming -= 1
        if conn.preread is not None and conn.preread.read(1):  # a pipelined request was read ahead with this one
            conn.preread.seek(-1, 1)
            if not fs.cancelled() and fs.exception() is None and fs.result() is True:
                self.enqueue_req(conn)
                return
        super().finish_request(conn, fs)

    def handle(self, conn: TConn) -> Any:
        assert isinstance(conn, ZooConn)  # made by accept
        conn.deadline = time.monotonic() + conn.header_timeout  # headers the event loop did not read ahead
        return super().handle(conn)

    def handle_request(self, req: Any, conn: TConn) -> Any:
        assert isinstance(conn, ZooConn)  # made by accept
        if conn.continued:  # the event loop said 100 Continue already
            req._expected_100_continue = False
            conn.continued = False
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
        # gunicornc's control socket: one path per user (~/.gunicorn/gunicorn.ctl), so two `zoo serve` of one user bound
        # the same socket and stopping one deleted the other's; zoo does not use it
        "control_socket_disable": True,
    }
    if logs.json_logs():  # JSON lines from the master and the workers; the app logs each request with its id
        options.update(logconfig_dict=logs.gunicorn_logconfig(), accesslog=None)
    from webapp.security import gunicorn_errors_as_json

    gunicorn_errors_as_json()  # what gunicorn refuses itself (414, 431, 400) in the API's JSON error shape, in every worker
    # every worker counts into one directory, so that a scrape of any of them reports all (zoo/metrics.py); set before
    # any process imports prometheus-client
    made = not os.environ.get(metrics.MULTIPROC_ENV)
    metrics_dir = metrics.use_multiprocess_dir("serve")
    options["child_exit"] = lambda _server, worker: metrics.process_exited(worker.pid)
    try:
        ZooServer(settings, options).run()
    finally:
        metrics.clear_multiprocess_dir(metrics_dir, made)
