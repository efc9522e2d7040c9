"""What a read token costs: `GET /api/v1/jobs` from 8 clients against `zoo serve --workers 1` on SQLite, once open (the
baseline) and once under ZOO_READ_TOKEN_REQUIRED with one token (looked up on every request, its last use stamped at
most once a minute), in alternating rounds of the same run; prints requests/s and p99 of each and their ratio.

    python -m bench.token_reads [--seconds 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.attack import probe

CLIENTS = 8


def _serve(base: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [*base, "serve", "--port", str(port), "--workers", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 60
    while max(probe(port, 0.01, timeout=1)) >= 1:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("zoo serve did not start")
        time.sleep(0.2)
    return proc, port


def _load(port: int, headers: dict[str, str], seconds: float) -> dict[str, float]:
    """CLIENTS threads, each a new connection per request, for `seconds`: requests/s and p99 in ms (non-200s fail)."""
    times: list[float] = []
    stop = time.monotonic() + seconds

    def client() -> None:
        while time.monotonic() < stop:
            t = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/api/v1/jobs", headers=headers)
            response = conn.getresponse()
            response.read()
            conn.close()
            if response.status != 200:
                raise RuntimeError(f"GET /api/v1/jobs answered {response.status}")
            times.append(time.perf_counter() - t)

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    t0 = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    times.sort()
    return {"per_s": len(times) / (time.monotonic() - t0), "p99_ms": 1e3 * times[int(0.99 * (len(times) - 1))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of load per round and server")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="token-reads-"))
    base = [sys.executable, "-m", "zoo.cli", "--db", f"sqlite:///{root / 'zoo.db'}", "--data-dir", str(root / "data")]
    subprocess.run([*base, "init"], check=True, capture_output=True)
    made = subprocess.run([*base, "token", "create", "bench", "--json"], check=True, capture_output=True, text=True).stdout
    token = json.loads(made)["token"]
    servers = {
        "open": (_serve(base, dict(os.environ)), {}),
        "token": (_serve(base, {**os.environ, "ZOO_READ_TOKEN_REQUIRED": "1"}), {"Authorization": f"Bearer {token}"}),
    }
    results: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    try:
        for _ in range(args.rounds):
            for name, ((_, port), headers) in servers.items():
                results[name].append(_load(port, headers, args.seconds))
    finally:
        for (proc, _), _ in servers.values():
            proc.terminate()
            proc.wait()
    for name, rounds in results.items():
        shown = ", ".join(f"{r['per_s']:.1f}/s p99 {r['p99_ms']:.0f} ms" for r in rounds)
        print(f"{name:>5}: {shown}")
    ratio = sum(r["per_s"] for r in results["token"]) / sum(r["per_s"] for r in results["open"])
    load = f"{CLIENTS} clients, {args.rounds} rounds of {args.seconds:g} s"
    print(f"token reads / open reads: {ratio:.2f} of the requests per second ({load})")


if __name__ == "__main__":
    main()
