"""Benchmark: the relation step run again on a copy of a data dir, its scans and edges cleared, timed (and profiled).

`zoo embed` runs the relation step once, after embedding; this runs only the step, as `zoo embed` does
(`scan_space` with the step's engine), on a copy of a SQLite data dir that a bench left (bench.realsize's --work
WORK/data, bench.lineage's WORK/data), so that two versions of the code can be timed on the same adapters one after
the other (run it from each checkout) and their edges compared:

    python -m bench.relation_rerun WORK/data --out /tmp/rerun-a [--profile] [--space SUBSTRING]

Prints, per space, the step's wall and CPU ms per adapter and its report; writes OUT_edges.json (every stored edge:
child, parent, relation, parameters, confidence, sorted) and, with --profile, OUT.prof and the cProfile summary.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import sqlite3
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", type=Path, help="a SQLite data dir (zoo.db and blobs/ in it); it is copied, not changed")
    parser.add_argument("--out", required=True, help="prefix of what is written: OUT_data/ (the copy), OUT_edges.json, OUT.prof")
    parser.add_argument("--space", default="", help="only the spaces whose base model contains this")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    copy = Path(args.out + "_data")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(args.data, copy)
    with sqlite3.connect(copy / "zoo.db") as db:
        db.execute("delete from adapter_relation")
        db.execute("delete from relation_scan")
    os.environ["ZOO_DATA_DIR"] = str(copy)
    os.environ.pop("ZOO_DATABASE_URL", None)
    from zoo.config import Settings
    from zoo.services.relations import relation_engine, scan_space
    from zoo.store.blobs import BlobStore
    from zoo.store.session import session_factory

    settings = Settings.load()
    sessions, blobs = session_factory(settings.database_url), BlobStore(settings.blob_dir)
    with sqlite3.connect(copy / "zoo.db") as db:
        spaces = [r[0] for r in db.execute("select distinct base_model from adapter order by base_model") if args.space in r[0]]
    profile = cProfile.Profile() if args.profile else None
    for space in spaces:
        wall, cpu = time.perf_counter(), time.process_time()
        if profile:
            profile.enable()
        report = scan_space(relation_engine(sessions, blobs, settings.data_dir), sessions, blobs, space)
        if profile:
            profile.disable()
        n = max(report["scanned"], 1)
        wall_ms, cpu_ms = 1000 * (time.perf_counter() - wall) / n, 1000 * (time.process_time() - cpu) / n
        print(f"{space}: {wall_ms:.0f} ms an adapter ({cpu_ms:.0f} ms CPU), {json.dumps(report)}")
    with sqlite3.connect(copy / "zoo.db") as db:
        edges = sorted(db.execute("select child_id, parent_id, relation, parameters, confidence from adapter_relation"))
    Path(args.out + "_edges.json").write_text(json.dumps(edges, indent=0))
    print(f"edges {len(edges)} ({args.out}_edges.json)")
    if profile:
        profile.dump_stats(args.out + ".prof")
        pstats.Stats(profile).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
