"""Benchmark: the relation step's cost per adapter in a space of a million adapters, against a small space.

The goal (docs/results.md): the relation step (zoo/services/relations.py) costs at most 50 ms per adapter added to ingest at a
million adapters. Its work per adapter is O(k): its FETCHED nearest by the engine's module-sketch and raw-factor
indexes (searched for BATCH adapters at once), their sketch vectors from the engine's index (`later_copies`), the
factors of up to NEIGHBOURS of them from the blob store, `find_relations`, the merge test again for up to RECHECK close
neighbours scanned before it, and one write transaction. This bench measures it, part by part, in two synthetic
spaces built the same way in one run:

- the source: a shapes-lineage zoo (`zoo make-zoo --recipe shapes-lineage`, or --zoo), stored with its labels,
  `zoo embed` (its own relation step: the reference row, real neighbourhoods) and a short `zoo train` (the synthetic
  space has a W2T index, as a served one does; bench/serve.py needs it);
- the spaces: bench/serve.py's `build` (SQLite, both FAISS indexes, IVF above 100k): every synthetic adapter mixes
  two real ones plus noise. They have no factors of their own: each is given the factors blob (and
  `factor_summary`) of a real adapter, so the detectors compare real factors for every neighbour, and the source's
  blob store is linked under the space's data dir. Which real adapter (`--factors`):
  `structure` (default), one drawn per synthetic adapter among the real ones of its main parent's structure, so the
  detectors' work has the same distribution at every N; `main-parent`, its main parent's, so that at a million,
  where a neighbourhood is the ~280 mixtures of one pair of real adapters, every neighbour is the query's own blob
  (`identical`, the transform test's early exit) and the detectors' work shrinks with N;
- the ingest situation: every adapter but the sample is marked scanned at an older space version, so each sampled
  adapter is a newly embedded one, and its close neighbours (not already its partners) get the merge test again,
  as at ingest. The edge table starts empty.

The step runs as `zoo embed` runs it, `scan_space(engine, sessions, blobs, space, ids=sample)`, on `--sample`
adapters of each space (after `--warmup` others), with its parts timed by wrapping them (nothing is added to
zoo/): the engine searches (`stored_neighbours`), the later copies and copy sources among the neighbours, factor
loading (database and blobs), `find_relations` and the merge tests, the write transaction, and the rest (the space
version read, `scanned_before`). A batch's shared work counts in its first adapter's row (each row begins where the
one before ended), so the mean is the figure to read; the percentiles are no longer one adapter's.

    python -m bench.relations_scale --work /tmp/rscale --zoo ZOO --adapters 1000000 --small 10000

--work keeps the source zoo's data dir, the spaces (space-N/) and the build reports: a run again reuses what is
there (--rebuild builds the spaces again). Prints a table and, on the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from bench import lineage, serve

#: the parts of one adapter's scan that are timed (wrapped), in the order printed
PARTS = ("engine", "sketches", "factors", "detect", "store", "other")
CHUNK = 50_000


# -- the source zoo ---------------------------------------------------------------------------------------------------


def source_zoo(args: argparse.Namespace, env: dict[str, str], database_url: str) -> dict[str, Any]:
    """Build (or reuse) the shapes-lineage zoo, store it, `zoo embed` and `zoo train` it; the figures of each step."""
    zoo_dir, built = lineage.build(env, args.work, args.zoo, args.count, args.seed, 2)
    members = lineage.read_members(zoo_dir / "labels.csv")
    ids, _, ingest_s = lineage.ingest(env, args.work, zoo_dir, members)
    embed_s, relations = lineage.embed(env, args.work, database_url, rescan=False)
    trained = args.work / "train.json"
    if not trained.exists():
        seconds, _ = lineage.zoo(env, "train", "--epochs", str(args.epochs), "--members", "1", "--json")
        trained.write_text(json.dumps({"seconds": seconds, "epochs": args.epochs}))
    return {"zoo": str(zoo_dir), "build": built, "stored": len(set(ids.values())), "ingest_s": ingest_s, "embed_s": embed_s,
            "step_ms_per_adapter": relations.get("ms_per_adapter"), "train": json.loads(trained.read_text())}  # fmt: skip


def real_factors(database_url: str, src: serve.Source) -> list[tuple[str, str | None, str]]:
    """(factors blob, factor summary as JSON, structure hash) of each real adapter of `src`, in its row order: by name,
    of the adapters with both embeddings, as `serve.load_source` orders them (checked against their stored sketches)."""
    from sqlalchemy import select

    from embed.serving.resources import resolve_space
    from zoo.store.embedders import active_embedder
    from zoo.store.embeddings import load_embeddings
    from zoo.store.models import Adapter
    from zoo.store.session import session_factory

    with session_factory(database_url)() as session:
        space = resolve_space(session, None)
        embedded = []
        for method in ("module_sketch", "w2t"):
            embedder = active_embedder(session, space, method)
            assert embedder is not None
            embedded.append(load_embeddings(session, embedder))
        rows = {
            r.id: r
            for r in session.execute(select(Adapter.id, Adapter.name, Adapter.factors_blob, Adapter.factor_summary, Adapter.structure_hash))
        }
    sketches = dict(zip(embedded[0][0].tolist(), embedded[0][1], strict=True))
    both = sorted((rows[i] for i in set(sketches) & set(embedded[1][0].tolist())), key=lambda r: r.name)
    assert len(both) == len(src.sketches) and all(np.array_equal(sketches[r.id], s) for r, s in zip(both, src.sketches, strict=True))
    assert all(r.factors_blob for r in both), "a real adapter has no factors blob"
    return [(r.factors_blob, json.dumps(r.factor_summary) if r.factor_summary is not None else None, r.structure_hash) for r in both]


def factor_rows(src: serve.Source, structures: list[str], start: int, stop: int, seed: int, policy: str) -> np.ndarray:
    """The real adapter (a row of `src`) whose factors synthetic adapters start+1..stop are given (see `--factors`)."""
    main = serve.parents(src, start, stop, seed)[0]
    if policy == "main-parent":
        return main
    order = np.argsort(np.array(structures), kind="stable")  # rows grouped by structure
    group = np.array(structures)[order]
    first = np.searchsorted(group, np.array(structures), side="left")
    size = np.searchsorted(group, np.array(structures), side="right") - first
    u = np.random.default_rng([seed, 1, start]).uniform(0, 1, stop - start)
    return order[first[main] + (u * size[main]).astype(np.int64)]  # type: ignore[no-any-return]


# -- the spaces -------------------------------------------------------------------------------------------------------


def build_space(src: serve.Source, n: int, space: Path, seed: int, rebuild: bool) -> dict:
    """bench/serve.py's synthetic space of n adapters under `space` (a child process: its peak RSS is its own); its
    figures, read back from space/build.json when built before."""
    done = space / "build.json"
    if done.exists() and not rebuild:
        return json.loads(done.read_text())  # type: ignore[no-any-return]
    for stale in ("zoo.db", "factors.json"):
        (space / stale).unlink(missing_ok=True)
    space.mkdir(parents=True, exist_ok=True)
    return serve.build_or_reuse(src, n, space, seed, reuse=False)  # type: ignore[no-any-return]


def give_factors(
    src: serve.Source, real: list[tuple[str, str | None, str]], n: int, space: Path, seed: int, policy: str, blobs: Path
) -> float:
    """Give every synthetic adapter the factors blob and summary of a real one (a temporary table and one UPDATE) and
    link the source's blob store under the space; the seconds it took (0 when done before with this policy)."""
    done = space / "factors.json"
    if done.exists() and json.loads(done.read_text())["policy"] == policy:
        return 0.0
    from zoo.store.session import make_engine

    t0 = time.perf_counter()
    link = space / "blobs"
    if not link.is_symlink():
        link.symlink_to(blobs.resolve())
    with make_engine(f"sqlite:///{space / 'zoo.db'}").begin() as conn:
        conn.exec_driver_sql("CREATE TEMP TABLE real_factors (k INTEGER PRIMARY KEY, blob TEXT, summary TEXT)")
        conn.exec_driver_sql("CREATE TEMP TABLE pick (id INTEGER PRIMARY KEY, k INTEGER)")
        conn.exec_driver_sql("INSERT INTO real_factors VALUES (?, ?, ?)", [(k, b, s) for k, (b, s, _) in enumerate(real)])
        structures = [h for _, _, h in real]
        for start in range(0, n, CHUNK):
            stop = min(n, start + CHUNK)
            rows = factor_rows(src, structures, start, stop, seed, policy)
            conn.exec_driver_sql("INSERT INTO pick VALUES (?, ?)", list(zip(range(start + 1, stop + 1), rows.tolist(), strict=True)))
        conn.exec_driver_sql(
            "UPDATE adapter SET factors_blob = r.blob, factor_summary = r.summary FROM pick p JOIN real_factors r ON r.k = p.k "
            "WHERE adapter.id = p.id"
        )
    done.write_text(json.dumps({"policy": policy}))
    return time.perf_counter() - t0


def as_at_ingest(database_url: str, fresh: list[int]) -> None:
    """No edges; every adapter scanned by the current detector at space version 0 (before any was embedded) but
    `fresh`, which are to scan: their close neighbours get the merge test again, as a new adapter's do."""
    from sqlalchemy import text

    from zoo.domain.relations import DETECTOR
    from zoo.store.session import make_engine

    with make_engine(database_url).begin() as conn:
        conn.execute(text("DELETE FROM adapter_relation"))
        conn.execute(text("DELETE FROM relation_scan"))
        conn.execute(text("INSERT INTO relation_scan (adapter_id, detector, space_version) SELECT id, :d, 0 FROM adapter"), {"d": DETECTOR})
        conn.execute(text("DELETE FROM relation_scan WHERE adapter_id IN (SELECT value FROM json_each(:ids))"), {"ids": json.dumps(fresh)})


# -- measuring --------------------------------------------------------------------------------------------------------


class Parts:
    """Seconds spent in each timed part of the relation step, one row per adapter scanned (cut where its write
    transaction ends), with how many close neighbours it tested again as merges."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self.current: dict[str, float] = defaultdict(float)
        self.started = 0.0

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            if part == "version":
                self.started = t  # a batch begins with reading the space version; its shared work is its first row's
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - t
                self.current[f"{part}_calls"] += 1
                if part == "store":
                    self.close(time.perf_counter())

        return run

    def close(self, end: float) -> None:
        c = self.current
        row = {"total": end - self.started, **{p: c[p] for p in PARTS[:-1]}, "rechecks": c["recheck_calls"]}
        row["other"] = row["total"] - sum(row[p] for p in PARTS[:-1])
        self.rows.append(row)
        self.current = defaultdict(float)
        self.started = end  # the next adapter's row begins where this one's write ended


@contextmanager
def timing(engine: Any) -> Iterator[Parts]:
    """The relation step's parts wrapped with timers while inside."""
    from zoo.services import factor_cache, relations

    parts = Parts()
    with ExitStack() as stack:
        for owner, name, part in (
            (relations, "space_version", "version"),
            (engine, "stored_neighbours", "engine"),
            (relations.RelationScan, "later_copies_of", "sketches"),
            (relations.RelationScan, "read_copies", "sketches"),
            (relations, "merge_naming", "recheck"),
            (factor_cache.FactorCache, "get", "factors"),
            (relations, "find_relations", "detect"),
            (relations, "find_merge", "detect"),
            (relations, "store_edges", "store"),
        ):
            stack.enter_context(mock.patch.object(owner, name, parts.timed(part, getattr(owner, name))))
        yield parts


def measure(data_dir: Path, database_url: str, blobs: Path, sample: list[int], warmup: list[int]) -> dict[str, Any]:
    """Scan `warmup`, then `sample` (timed by part), in the space of this data dir, marked as at ingest."""
    from sqlalchemy import text

    from embed.serving.engine import QueryEngine
    from zoo.services.relations import scan_space
    from zoo.store.blobs import BlobStore
    from zoo.store.session import session_factory

    as_at_ingest(database_url, sample + warmup)
    sessions = session_factory(database_url)
    engine = QueryEngine(sessions, BlobStore(blobs), data_dir)
    with sessions() as session:
        space = session.execute(text("select name from embedding_space")).scalar_one()
        t0 = time.perf_counter()
        engine.space(session, space)
        load_s = time.perf_counter() - t0
    scan_space(engine, sessions, BlobStore(blobs), space, ids=warmup)
    before = edge_counts(sessions)
    with timing(engine) as parts:
        report = scan_space(engine, sessions, BlobStore(blobs), space, ids=sample)
    if report["failed"] or report["not_ready"] or report["scanned"] != len(sample):
        sys.exit(f"the relation step did not scan the sample: {report}")
    edges = edge_counts(sessions) - before
    return {"load_s": load_s, "rows": parts.rows, "report": report, "edges": dict(edges), "rss_gb": serve.rss_gb()}


def edge_counts(sessions: Any) -> Counter[str]:
    """Stored edges by relation."""
    from sqlalchemy import func, select

    from zoo.store.models import AdapterRelation

    with sessions() as session:
        return Counter(dict(session.execute(select(AdapterRelation.relation, func.count()).group_by(AdapterRelation.relation)).all()))


def summary(measured: dict[str, Any]) -> dict[str, Any]:
    """ms per adapter (p50, p99, mean) and the mean of each part, from one measurement's rows."""
    rows = measured["rows"]
    total = np.array([r["total"] for r in rows]) * 1e3
    out = {"scanned": len(rows), "p50_ms": float(np.percentile(total, 50)), "p99_ms": float(np.percentile(total, 99)),
           "mean_ms": float(total.mean()), "max_ms": float(total.max())}  # fmt: skip
    out |= {f"{p}_ms": float(np.mean([r[p] for r in rows]) * 1e3) for p in PARTS}
    out["engine_p99_ms"] = float(np.percentile([r["engine"] for r in rows], 99) * 1e3)
    out["rechecks_per_adapter"] = float(np.mean([r["rechecks"] for r in rows]))
    out["edges"] = measured["edges"]
    out["edges_per_adapter"] = sum(measured["edges"].values()) / len(rows)
    out["step_ms_per_adapter"] = measured["report"]["ms_per_adapter"]  # scan_space's own figure: untimed, to check the rows
    out["load_s"], out["rss_gb"] = measured["load_s"], measured["rss_gb"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def run_space(args: argparse.Namespace, src: serve.Source, real: list, n: int, blobs: Path) -> dict[str, Any]:
    """Build (or reuse) the space of n synthetic adapters, give them factors, and measure the step on a sample."""
    space = args.work / f"space-{n}"
    print(f"space of {n}: building", file=sys.stderr, flush=True)
    built = build_space(src, n, space, args.seed, args.rebuild)
    factors_s = give_factors(src, real, n, space, args.seed, args.factors, blobs)
    rng = np.random.default_rng([args.seed, 2])
    ids = (rng.choice(n, args.sample + args.warmup, replace=False) + 1).tolist()
    print(f"space of {n}: built in {built['build_s']:.0f} s; measuring", file=sys.stderr, flush=True)
    result = summary(measure(space, f"sqlite:///{space / 'zoo.db'}", space / "blobs", ids[: args.sample], ids[args.sample :]))
    return result | {"adapters": n, "build_s": round(built["build_s"], 1), "build_peak_rss_gb": round(built["peak_rss_gb"], 2),
                     "build_steps_s": built["steps_s"], "nprobe": built["nprobe"], "factors_s": round(factors_s, 1)}  # fmt: skip


def run_real(database_url: str, data_dir: Path) -> dict[str, Any]:
    """The same measurement in the source zoo itself (its real neighbourhoods), every adapter in the sample."""
    from sqlalchemy import text

    from zoo.store.session import make_engine

    with make_engine(database_url).connect() as conn:
        ids = [int(i) for i in conn.execute(text("SELECT id FROM adapter WHERE factors_blob IS NOT NULL ORDER BY id")).scalars()]
    measure(data_dir, database_url, data_dir / "blobs", ids, [])  # warm-up: the same scans, untimed
    return summary(measure(data_dir, database_url, data_dir / "blobs", ids, [])) | {"adapters": len(ids)}


# -- output -----------------------------------------------------------------------------------------------------------


def print_table(result: dict[str, Any]) -> None:
    real, small, large = result["real"], result["small"], result["large"]
    cols = [real, small, large]
    head = (
        f"real zoo ({real['adapters']})",
        f"{small['adapters']:,}",
        f"{large['adapters']:,}",
        f"{large['adapters']:,} / {small['adapters']:,}",
    )
    print(f"| ms per adapter | {' | '.join(head)} |\n| --- | --- | --- | --- | --- |")

    def row(label: str, key: str, fmt: str = "{:.1f}") -> None:
        ratio = large[key] / small[key] if small[key] else float("nan")
        print(f"| {label} | {' | '.join(fmt.format(c[key]) for c in cols)} | {ratio:.2f} |")

    for label, key in (("p50", "p50_ms"), ("p99", "p99_ms"), ("mean", "mean_ms")):
        row(f"**{label}**", key)
    names = {"engine": "engine searches (stored_neighbours)", "sketches": "later copies, copy sources", "factors": "factors (DB + blobs)",
             "detect": "find_relations", "store": "write transaction", "other": "rest (version, scanned_before)"}  # fmt: skip
    for p in PARTS:
        row(f"— {names[p]}, mean", f"{p}_ms")
    row("engine query p99", "engine_p99_ms")
    row("rechecks per adapter", "rechecks_per_adapter", "{:.2f}")
    row("edges per adapter", "edges_per_adapter", "{:.2f}")
    print(f"\nedges: real {real['edges']}; {small['adapters']:,}: {small['edges']}; {large['adapters']:,}: {large['edges']}")
    for c in (small, large):
        built = f"built in {c['build_s']:.0f} s (peak RSS {c['build_peak_rss_gb']:.2f} GB, nprobe {c['nprobe']})"
        print(f"space of {c['adapters']:,}: {built}, loaded in {c['load_s']:.1f} s, RSS after the step {c['rss_gb']:.2f} GB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, required=True, help="the source zoo's data dir, the spaces and the reports (reused when there)")
    p.add_argument("--zoo", type=Path, help="an existing shapes-lineage zoo (default: build one under --work)")
    p.add_argument("--count", type=int, default=60, help="members of the zoo built (default: %(default)s)")
    p.add_argument("--adapters", type=int, default=1_000_000, help="synthetic adapters of the large space (default: %(default)s)")
    p.add_argument("--small", type=int, default=10_000, help="synthetic adapters of the baseline space (default: %(default)s)")
    p.add_argument("--sample", type=int, default=200, help="adapters scanned (timed) in each space (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=10, help="adapters scanned before, untimed (default: %(default)s)")
    p.add_argument("--factors", choices=("structure", "main-parent"), default="structure", help="whose factors a synthetic adapter gets")
    p.add_argument("--noise", type=float, default=0.02, help="bench/serve.py's mixing noise (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=3, help="zoo train --epochs for the source's W2T (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rebuild", action="store_true", help="build the spaces again")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / "data"
    database_url = f"sqlite:///{data / 'zoo.db'}"
    env = {**os.environ, "ZOO_DATA_DIR": str(data), "ZOO_DATABASE_URL": database_url}
    source = source_zoo(args, env, database_url)
    src = serve.load_source(database_url, data, args.noise)
    real = real_factors(database_url, src)
    result: dict[str, Any] = {"source": source, "real_adapters": len(real), "structures": len({h for _, _, h in real})}
    result["real"] = run_real(database_url, data)
    result["small"] = run_space(args, src, real, args.small, data / "blobs")
    result["large"] = run_space(args, src, real, args.adapters, data / "blobs")
    ratio = {k: round(result["large"][k] / result["small"][k], 3) for k in ("p50_ms", "p99_ms", "mean_ms") if result["small"][k]}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    result |= {"ratio_large_to_small": ratio, "peak_rss_gb": round(peak, 2), "factors": args.factors, "sample": args.sample,
               "load_average": os.getloadavg(), "synthetic": True}  # fmt: skip
    print_table(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
