"""Benchmark: similar-adapter requests over HTTP through `zoo serve`, against the engine's own time.

The space is bench/serve.py's synthetic one (mixtures of a real zoo's adapters; see there), by
default 100,000 adapters. `zoo serve` (gunicorn, --workers processes × --threads threads) serves
it on loopback; --clients threads, each on its own keep-alive connection, send
`GET /api/v1/adapters/{id}/similar?k=10` for random ids. In the same run it measures:
- the HTTP latency each client sees (p50, p99) and requests/s;
- the engine's time for the same requests, from the `Server-Timing: engine;dur=` header the API
  sets around its engine call, and so the web layer's share: HTTP minus engine, per request (with
  --clients at once it includes waiting for a core; one client alone gives the layer's own cost);
- the same queries through an in-process QueryEngine with as many threads (the engine baseline),
  in turns with the HTTP requests (--rounds) so that both meet the same background load.

    python -m bench.api --zoo-data-dir DIR   # DIR: a data dir where `zoo train` ran

Prints a table and, on the last line, one JSON object.

Under attack, `--attacks` serves that real zoo itself with `zoo serve` as shipped (--workers, its
default threads, deadlines and bounded pool) and measures, each for --attack-seconds:
- GET /api/v1/health p50/p99 idle and during 16 slow clients (headers dripped a byte every 0.5 s);
- GET /api/v1/adapters/{id}/similar?k=10 p50/p99 idle and during 16 clients sending predict/performance with
  100 ids over and over (and health during them), with the statuses the flood got;
and `--catalog URL` adds bench.catalog's figures (text + facets, unfiltered facets, 5 filters) for a catalog
database it builds there (a million adapters by default: --catalog-adapters).

    python -m bench.api --zoo-data-dir DIR --attacks [--catalog postgresql://.../zoo_bench_catalog]
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.serve import build_or_reuse, load_source, percentiles


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:  # type: ignore[type-arg]
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"zoo serve exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/api/v1/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("zoo serve did not come up")


def run_clients(port: int, ids: np.ndarray, clients: int) -> tuple[list[float], list[float], float]:
    """(HTTP seconds, engine seconds) per request and the wall time, `clients` keep-alive connections at once."""
    parts = np.array_split(ids, clients)

    def client(part: np.ndarray) -> list[tuple[float, float]]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        out = []
        for i in part.tolist():
            t = time.perf_counter()
            conn.request("GET", f"/api/v1/adapters/{i}/similar?k=10")
            response = conn.getresponse()
            body = response.read()
            elapsed = time.perf_counter() - t
            if response.status != 200:
                raise SystemExit(f"request for {i}: {response.status} {body[:200]!r}")
            timing = response.getheader("Server-Timing") or ""
            out.append((elapsed, float(timing.split("dur=")[1]) / 1e3))
        conn.close()
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for part in pool.map(client, parts) for r in part]
    return [h for h, _ in results], [e for _, e in results], time.perf_counter() - t0


class EngineBaseline:
    """The same queries through an in-process engine, `threads` at once (seconds each)."""

    def __init__(self, work: Path, space: str, threads: int) -> None:
        from embed.serving.engine import QueryEngine
        from zoo.store.blobs import BlobStore
        from zoo.store.session import session_factory

        self.sessions = session_factory(f"sqlite:///{work / 'zoo.db'}")
        self.engine = QueryEngine(self.sessions, BlobStore(work / "blobs"), work)
        self.space, self.threads = space, threads

    def one(self, i: int) -> float:
        from embed.serving.results import Query

        with self.sessions() as session:
            t = time.perf_counter()
            self.engine.similar(session, self.space, Query(str(i), i), 10)
            return time.perf_counter() - t

    def run(self, ids: np.ndarray) -> list[float]:
        with ThreadPoolExecutor(self.threads) as pool:
            return list(pool.map(self.one, ids.tolist()))


def attacks(database_url: str, data_dir: Path, workers: int, seconds: float, log: Path) -> dict[str, object]:
    """Health and similar latencies (ms) of a real zoo served as shipped, idle and under the two attacks."""
    from sqlalchemy import select

    from bench.attack import Flood, SlowClients, post_json, probe
    from zoo.store.models import Adapter
    from zoo.store.session import session_factory

    with session_factory(database_url)() as session:
        ids = list(session.scalars(select(Adapter.id).order_by(Adapter.id).limit(100)))
    hundred = [ids[i % len(ids)] for i in range(100)]
    similar = f"/api/v1/adapters/{ids[0]}/similar?k=10"
    port = free_port()
    cmd = [sys.executable, "-m", "zoo.cli", "--db", database_url, "--data-dir", str(data_dir), "serve"]
    out: dict[str, object] = {"workers": workers, "attack_seconds": seconds}
    with open(log, "w") as fh:
        proc = subprocess.Popen([*cmd, "--port", str(port), "--workers", str(workers)], stdout=fh, stderr=subprocess.STDOUT)
        try:
            wait_healthy(port, proc)
            probe(port, 2, path=similar)  # every worker loads its engine
            runs = {"health_idle": probe(port, seconds), "similar_idle": probe(port, seconds, path=similar)}
            with SlowClients(port, 16):
                time.sleep(0.5)
                runs["health_16_slow_clients"] = probe(port, seconds)
            with Flood(port, 16, post_json("/api/v1/predict/performance", {"adapter_ids": hundred})) as flood:
                time.sleep(0.5)
                runs["similar_16_predict_floods"] = probe(port, seconds, path=similar)
                runs["health_16_predict_floods"] = probe(port, seconds)
            out["predict_flood_statuses"] = {str(k): v for k, v in sorted(flood.statuses.items())}
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    for name, times in runs.items():
        p50, p99 = percentiles(times)
        out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = round(p50, 1), round(p99, 1)
        out[f"{name}_failed"] = sum(t >= 5 for t in times)
    return out


def main_attacks(args: argparse.Namespace) -> None:
    import os

    from zoo.config import Settings

    result: dict[str, object] = {"load_1min": round(os.getloadavg()[0], 2)}
    settings = Settings.load(args.zoo_db, args.zoo_data_dir)
    work = args.work or Path(tempfile.mkdtemp(prefix="zoo-bench-attacks-"))
    work.mkdir(parents=True, exist_ok=True)
    result["attacks"] = attacks(settings.database_url, settings.data_dir, args.workers, args.attack_seconds, work / "serve.log")
    if args.catalog:
        from bench.catalog import build, measure

        result["catalog"] = {"adapters": args.catalog_adapters, "build_s": round(build(args.catalog, args.catalog_adapters), 1)}
        result["catalog"].update(measure(args.catalog, args.catalog_repeats))  # type: ignore[attr-defined]
    for key, value in result["attacks"].items():  # type: ignore[attr-defined]
        print(f"{key:40s} {value}")
    for key, value in dict(result.get("catalog") or {}).items():  # type: ignore[call-overload]
        print(f"catalog {key:32s} {value}")
    print(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=100_000)
    p.add_argument("--zoo-data-dir", type=Path, help="data dir of the real zoo (default: $ZOO_DATA_DIR)")
    p.add_argument("--zoo-db", help="its database URL (default: SQLite in the data dir)")
    p.add_argument("--work", type=Path, help="where to build the synthetic space (default: a temporary dir)")
    p.add_argument("--reuse", action="store_true", help="serve the space already built in --work")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4, help="turns of HTTP and in-process engine (default: %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="zoo serve processes (default: %(default)s)")
    p.add_argument("--threads", type=int, default=4, help="threads per process (default: %(default)s)")
    p.add_argument("--noise", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attacks", action="store_true", help="measure the real zoo under slow clients and a predict flood (see above)")
    p.add_argument("--attack-seconds", type=float, default=10.0)
    p.add_argument("--catalog", metavar="URL", help="with --attacks: bench.catalog on this PostgreSQL database (built there)")
    p.add_argument("--catalog-adapters", type=int, default=1_000_000)
    p.add_argument("--catalog-repeats", type=int, default=50)
    args = p.parse_args()
    if args.attacks:
        main_attacks(args)
        return

    from zoo.config import Settings

    settings = Settings.load(args.zoo_db, args.zoo_data_dir)
    src = load_source(settings.database_url, settings.data_dir, args.noise)
    work = args.work or Path(tempfile.mkdtemp(prefix="zoo-bench-api-"))
    work.mkdir(parents=True, exist_ok=True)
    build_or_reuse(src, args.adapters, work, args.seed, args.reuse)
    space = "synthetic/" + src.sketch_config["schema"]["base_model"]
    rng = np.random.default_rng(args.seed + 2)
    ids = rng.integers(1, args.adapters + 1, args.requests)
    port = free_port()
    cmd = [sys.executable, "-m", "zoo.cli", "--db", f"sqlite:///{work / 'zoo.db'}", "--data-dir", str(work), "serve"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--workers", str(args.workers), "--threads", str(args.threads)]
    baseline = EngineBaseline(work, space, args.clients)
    baseline.run(ids[:50])  # loads the engine
    http_s: list[float] = []
    engine_s: list[float] = []
    in_process: list[float] = []
    wall = 0.0
    with open(work / "serve.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(port, proc)
            t0 = time.perf_counter()
            run_clients(port, rng.integers(1, args.adapters + 1, 50 * args.workers * args.threads), args.clients)  # every worker loads
            warm_s = time.perf_counter() - t0
            # HTTP and the in-process engine take turns, so that both meet the same background load
            for part in np.array_split(ids, args.rounds):
                h, e, w = run_clients(port, part, args.clients)
                http_s, engine_s, wall = http_s + h, engine_s + e, wall + w
                in_process += baseline.run(part)
            one_http, one_engine, _ = run_clients(port, ids[: len(ids) // 4], 1)  # no queueing: the layer's own cost
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    overhead = [h - e for h, e in zip(http_s, engine_s, strict=True)]
    one_overhead = percentiles([h - e for h, e in zip(one_http, one_engine, strict=True)])
    (h50, h99), (e50, e99), (o50, o99), (b50, b99) = (percentiles(x) for x in (http_s, engine_s, overhead, in_process))
    result = {
        "adapters": args.adapters,
        "requests": len(ids),
        "clients": args.clients,
        "workers": args.workers,
        "threads": args.threads,
        "http_p50_ms": round(h50, 3),
        "http_p99_ms": round(h99, 3),
        "requests_per_s": round(len(ids) / wall, 1),
        "engine_in_server_p50_ms": round(e50, 3),
        "engine_in_server_p99_ms": round(e99, 3),
        "web_layer_p50_ms": round(o50, 3),
        "web_layer_p99_ms": round(o99, 3),
        "web_layer_p50_ms_1_client": round(one_overhead[0], 3),
        "web_layer_p99_ms_1_client": round(one_overhead[1], 3),
        "engine_in_process_p50_ms": round(b50, 3),
        "engine_in_process_p99_ms": round(b99, 3),
        "http_minus_engine_in_process_p50_ms": round(h50 - b50, 3),
        "http_minus_engine_in_process_p99_ms": round(h99 - b99, 3),
        "rounds": args.rounds,
        "warm_up_s": round(warm_s, 1),
        "synthetic": True,
    }
    print(
        f"{args.adapters} synthetic adapters, {args.clients} clients, zoo serve {args.workers} workers × {args.threads} threads\n"
        f"HTTP p50 {h50:.2f} ms, p99 {h99:.2f} ms, {result['requests_per_s']:.0f} requests/s\n"
        f"engine inside the server p50 {e50:.2f} ms, p99 {e99:.2f} ms: the web layer adds p50 {o50:.2f} ms, p99 {o99:.2f} ms\n"
        f"one client (no queueing): the web layer adds p50 {one_overhead[0]:.2f} ms, p99 {one_overhead[1]:.2f} ms\n"
        f"engine in process ({args.clients} threads) p50 {b50:.2f} ms, p99 {b99:.2f} ms"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
