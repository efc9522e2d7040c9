"""Hostile load on a running `zoo serve` (or the proxy in front of it), for bench.api and tests/test_attack.py.

Only loopback addresses are attacked, each load bounded in time and stopped by itself:
- `SlowClients`: n connections that drip a request's headers a byte at a time (slow-loris), each reopened
  when the server closes it, until stopped;
- `Flood`: n threads sending one request over and over (a 100-id predict call, a filter flood), until stopped;
- `probe`: a cheap request (GET /api/v1/health) sent again and again on fresh connections, its latencies (a
  request that fails or times out counts as its timeout);
- `DeleteRace`: adapters deleted while readers read them and `zoo ingest` and `zoo embed` run (`race_zoo` makes a zoo
  and a server for it; `python -m bench.attack race --db URL --seconds 60` runs it and prints what it got).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path


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


@dataclass
class DeleteRace:
    """Adapters deleted through the API while readers read them (catalog pages, details, similar, lineage, the
    pages) and `commands` (e.g. `zoo ingest`, `zoo embed`) run again and again as processes, for `seconds`: the
    statuses readers got per route, and every command run that did not exit 0 (its tail of stderr). Call `run`."""

    port: int
    token: str
    ids: list[int]
    commands: list[list[str]]
    readers: int = 2
    host: str = "127.0.0.1"
    statuses: dict[str, dict[int, int]] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)
    failed_runs: list[tuple[str, int, str]] = field(default_factory=list)
    deleted: list[int] = field(default_factory=list)

    def run(self, seconds: float) -> DeleteRace:
        stop = threading.Event()
        threads = [threading.Thread(target=self._read, args=(stop, i), daemon=True) for i in range(self.readers)]
        threads += [threading.Thread(target=self._delete, args=(stop,), daemon=True)]
        threads += [threading.Thread(target=self._command, args=(stop, cmd), daemon=True) for cmd in self.commands]
        for t in threads:
            t.start()
        stop.wait(seconds)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        return self

    def server_errors(self) -> dict[str, dict[int, int]]:
        """The routes that answered 5xx, with their statuses."""
        return {route: got for route, got in self.statuses.items() if any(s >= 500 or s == 0 for s in got)}

    def _count(self, route: str, status: int) -> None:
        got = self.statuses.setdefault(route, {})
        got[status] = got.get(status, 0) + 1

    def _read(self, stop: threading.Event, seed: int) -> None:
        import random

        rng = random.Random(seed)
        routes = [  # the catalog thrice: a page and its labels were read in two statements
            *[("catalog", lambda i: "/api/v1/adapters?per_page=100")] * 3,
            ("catalog page", lambda i: "/?q=&page=1"),
            ("adapter", lambda i: f"/api/v1/adapters/{i}"),
            ("adapter page", lambda i: f"/adapters/{i}"),
            ("similar", lambda i: f"/api/v1/adapters/{i}/similar?k=5"),
            ("lineage", lambda i: f"/api/v1/adapters/{i}/lineage"),
        ]
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        while not stop.is_set():
            route, path = rng.choice(routes)
            try:
                conn.request("GET", path(rng.choice(self.ids)))
                r = conn.getresponse()
                r.read()
                status = r.status
            except (OSError, http.client.HTTPException):
                status = 0
                conn.close()
                conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            self._count(route, status)
        conn.close()

    def _delete(self, stop: threading.Event) -> None:
        """Every 0.2 s until stopped: the next of half the given adapters (the other half stays to be read), and the
        newest adapter where the commands stored it (a `zoo embed` may be embedding it; `zoo ingest` stores it again)."""
        import random

        order = random.Random(1).sample(self.ids, len(self.ids))[: len(self.ids) // 2]
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        while not stop.wait(0.2):
            conn.request("GET", "/api/v1/adapters?sort=newest&per_page=1")
            newest = json.loads(conn.getresponse().read())["results"]
            fresh = [newest[0]["id"]] if newest and newest[0]["id"] not in self.ids else []
            targets, order = [*order[:1], *fresh], order[1:]
            for target in targets:
                conn.request("DELETE", f"/api/v1/adapters/{target}", headers={"Authorization": f"Bearer {self.token}"})
                r = conn.getresponse()
                r.read()
                self._count("delete", r.status)
                if r.status == 200:
                    self.deleted.append(target)
        conn.close()

    def _command(self, stop: threading.Event, cmd: list[str]) -> None:
        import subprocess

        name = " ".join(cmd[cmd.index("--data-dir") + 2 :] if "--data-dir" in cmd else cmd[-2:])
        while not stop.is_set():
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            self.runs[name] = self.runs.get(name, 0) + 1
            if done.returncode != 0:
                self.failed_runs.append((name, done.returncode, done.stderr[-3000:]))


@contextlib.contextmanager
def race_zoo(url: str, root: Path, workers: int = 2, adapters: int = 40) -> Iterator[tuple[int, str, list[int], list[str], Path]]:
    """A zoo for `DeleteRace` under `root` on the database at `url` (emptied first where it is PostgreSQL): `adapters`
    random PEFT adapters of TinyLM ingested and embedded, 8 more beside them, an admin token, and `zoo serve` with
    `workers` workers; yields (port, token, adapter ids, the `zoo` command line on that zoo, the folder of the 8)."""
    import subprocess
    import sys

    from sqlalchemy import select

    from tests.factories import write_random_peft_adapters
    from zoo.cli import main
    from zoo.store.models import Adapter
    from zoo.store.session import session_factory, upgrade
    from zoo.store.tokens import create_token

    if url.startswith("postgresql"):
        from tests.conftest import truncate_all

        truncate_all(url)
    else:
        upgrade(url)
    write_random_peft_adapters(root / "zoo", adapters)
    write_random_peft_adapters(root / "more", 8, seed=1)
    base = ["--db", url, "--data-dir", str(root / "data")]
    assert main([*base, "ingest", str(root / "zoo"), "--base-model", "tiny", "--json"]) == 0  # and embedded
    with session_factory(url).begin() as session:
        token = create_token(session, "deleter", scope="admin")[1]
        ids = list(session.scalars(select(Adapter.id).order_by(Adapter.id)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "zoo.cli", *base]
    with (root / "serve.log").open("wb") as log:
        proc = subprocess.Popen([*cmd, "serve", "--port", str(port), "--workers", str(workers)], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline_s = time.monotonic() + 60
            while not probe(port, 0.01, timeout=1) or max(probe(port, 0.01, timeout=1)) >= 1:
                assert proc.poll() is None and time.monotonic() < deadline_s, (root / "serve.log").read_text()[-2000:]
                time.sleep(0.2)
            yield port, token, ids, cmd, root / "more"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def slow_clients(clients: int, seconds: float) -> dict[str, object]:
    """`zoo serve --workers 1` (its defaults) on an empty SQLite zoo; health probed quiet for 3 s, then for `seconds`
    while `clients` / 2 connections drip their headers and as many their bodies (`SlowClients`)."""
    import statistics
    import subprocess
    import sys
    import tempfile

    from zoo.store.session import upgrade

    with tempfile.TemporaryDirectory(prefix="zoo-slow-") as tmp:
        root = Path(tmp)
        url = f"sqlite:///{root / 'zoo.db'}"
        upgrade(url)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "zoo.cli",
            "--db",
            url,
            "--data-dir",
            str(root / "data"),
            "serve",
            "--port",
            str(port),
            "--workers",
            "1",
        ]
        with (root / "serve.log").open("wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            try:
                start = time.monotonic()
                while not probe(port, 0.01, timeout=1) or max(probe(port, 0.01, timeout=1)) >= 1:
                    assert proc.poll() is None and time.monotonic() - start < 90, (root / "serve.log").read_text()[-2000:]
                    time.sleep(0.2)
                quiet = probe(port, 3.0)
                body = "/api/v1/predict/performance"
                with SlowClients(port, clients // 2), SlowClients(port, clients - clients // 2, path=body, body=True):
                    time.sleep(1.0)  # every connection open and dripping
                    times = probe(port, seconds)
            finally:
                proc.terminate()
                proc.wait(timeout=20)
    ms = lambda t: round(1000 * t, 1)  # noqa: E731
    return {
        "clients": clients,
        "quiet": {"probes": len(quiet), "p50_ms": ms(statistics.median(quiet)), "p99_ms": ms(p99(quiet))},
        "slow": {
            "probes": len(times),
            "p50_ms": ms(statistics.median(times)),
            "p99_ms": ms(p99(times)),
            "timed_out": sum(t >= 5 for t in times),
        },
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.attack race --db URL --seconds 60`: the race of deletes, ingest, embed and reads on a fresh zoo
    (PostgreSQL: a database to throw away), its statuses per route and command runs as JSON; exit 1 on any 5xx or
    failed command run. `python -m bench.attack slow --clients 128 --seconds 10`: health under slow clients
    (`slow_clients`)."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m bench.attack")
    parser.add_argument("attack", choices=["race", "slow"])
    parser.add_argument("--db", help="race: database URL (emptied)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--readers", type=int, default=2)
    parser.add_argument("--clients", type=int, default=128, help="slow: slow clients, half dripping headers, half bodies")
    args = parser.parse_args(argv)
    if args.attack == "slow":
        print(json.dumps(slow_clients(args.clients, args.seconds)))
        return 0
    if not args.db:
        parser.error("race needs --db")
    with tempfile.TemporaryDirectory(prefix="zoo-race-") as tmp, race_zoo(args.db, Path(tmp)) as (port, token, ids, cmd, more):
        ingest = [*cmd, "ingest", "--no-embed", str(more), "--base-model", "tiny"]
        t0 = time.monotonic()
        race = DeleteRace(port, token, ids, [ingest, [*cmd, "embed"]], readers=args.readers).run(args.seconds)
        report = {
            "seconds": round(time.monotonic() - t0, 1),
            "statuses": race.statuses,
            "server_errors": race.server_errors(),
            "deleted": len(race.deleted),
            "runs": race.runs,
            "failed_runs": [(name, rc, tail[-600:]) for name, rc, tail in race.failed_runs],
        }
    print(json.dumps(report, indent=1))
    return 1 if report["server_errors"] or report["failed_runs"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
