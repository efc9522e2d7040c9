"""Hostile load on a running `zoo serve` (or the proxy in front of it), for bench.api and tests/test_attack.py.

Only loopback addresses are attacked, each load bounded in time and stopped by itself:
- `SlowClients`: n connections that drip a request's headers a byte at a time (slow-loris), each reopened
  when the server closes it, until stopped;
- `Flood`: n threads sending one request over and over (a 100-id predict call, a filter flood), until stopped;
- `probe`: a cheap request (GET /api/v1/health) sent again and again on fresh connections, its latencies (a
  request that fails or times out counts as its timeout).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class SlowClients:
    """`n` connections to host:port, each sending `GET path HTTP/1.1` headers one byte every `interval` seconds
    and never finishing them (with `body`: whole `POST path` headers declaring a 100,000-byte body, and then the body
    a byte at a time); a connection the server closes is opened again. Use as a context manager."""

    def __init__(
        self, port: int, n: int, host: str = "127.0.0.1", path: str = "/api/v1/health", interval: float = 0.5, body: bool = False
    ) -> None:
        self.host, self.port, self.n, self.path, self.interval, self.body = host, port, n, path, interval, body
        self.stop = threading.Event()
        self.closed_by_server = 0  # connections the server ended (a deadline at work)
        self.opened = 0
        self._threads = [threading.Thread(target=self._drip, daemon=True) for _ in range(n)]

    def _drip(self) -> None:
        if self.body:
            whole = f"POST {self.path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
            head = b'{"x": "' + b"a" * 100_000
        else:
            whole, head = "", f"GET {self.path} HTTP/1.1\r\nHost: {self.host}\r\n".encode() + b"X-Slow: " + b"a" * 100_000
        while not self.stop.is_set():
            try:
                with socket.create_connection((self.host, self.port), timeout=5) as s:
                    self.opened += 1
                    s.sendall(whole.encode())
                    for i in range(len(head)):
                        s.sendall(head[i : i + 1])
                        if self.stop.wait(self.interval):
                            return
            except OSError:
                self.closed_by_server += 1
                self.stop.wait(0.05)

    def __enter__(self) -> SlowClients:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=10)


@dataclass
class Flood:
    """`n` threads each sending `request(conn)` (on a keep-alive connection of its own) until stopped, counting
    the statuses they get. Use as a context manager."""

    port: int
    n: int
    request: Callable[[http.client.HTTPConnection], tuple[int, bytes]]
    host: str = "127.0.0.1"
    timeout: float = 60.0
    statuses: dict[int, int] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def _run(self) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        while not self.stop.is_set():
            try:
                status, _ = self.request(conn)
            except (OSError, http.client.HTTPException):
                status = 0
                conn.close()
                conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            self.statuses[status] = self.statuses.get(status, 0) + 1
        conn.close()

    def __enter__(self) -> Flood:
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(self.n)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout + 5)


def post_json(path: str, body: object, headers: dict[str, str] | None = None) -> Callable[[http.client.HTTPConnection], tuple[int, bytes]]:
    data = json.dumps(body).encode()

    def send(conn: http.client.HTTPConnection) -> tuple[int, bytes]:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read()

    return send


def get(path: str) -> Callable[[http.client.HTTPConnection], tuple[int, bytes]]:
    def send(conn: http.client.HTTPConnection) -> tuple[int, bytes]:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()

    return send


def probe(
    port: int, seconds: float, path: str = "/api/v1/health", timeout: float = 5.0, host: str = "127.0.0.1", pause: float = 0.05
) -> list[float]:
    """Seconds per `GET path` (each on a new connection, as a load balancer's health check) for `seconds`; a request
    that fails, times out or answers other than 200 counts as `timeout`."""
    out: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter()
        ok = False
        with contextlib.suppress(OSError, http.client.HTTPException):
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
            conn.request("GET", path)
            r = conn.getresponse()
            r.read()
            conn.close()
            ok = r.status == 200
        out.append(time.perf_counter() - t if ok else max(timeout, time.perf_counter() - t))
        time.sleep(pause)
    return out


def p99(times: list[float]) -> float:
    """The 99th percentile (nearest rank) of `times`."""
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, max(0, int(round(0.99 * len(ordered))) - 1))] if ordered else float("nan")
