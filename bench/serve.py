"""Benchmark: similar-by-id queries through the query engine on one synthetic space of N adapters.

The space is SYNTHETIC, derived from a real reference zoo: every synthetic adapter mixes two of
the zoo's real adapters (weights u and 1 - u, u uniform in [0.5, 1]) plus Gaussian noise, in
both of its stored representations: the module sketch (renormalized per module) and the W2T
embedding. It inherits the task of its main parent, so neighbourhoods have the zoo's structure;
a `shard` label with 100 values gives a filter that keeps 1 % of the zoo. There are no blobs, so
no module store: module cosine comes from the sketches, as in any space too big for the store.

Build (timed, in a child process so the serving process's memory is its own): a SQLite database
with the adapters, their labels and their embeddings, written in bulk, and both FAISS indexes
(IVF above 100k adapters). Serve: the engine loads the space, then answers `--queries` queries by
stored id with the default method (hybrid) single-threaded, with 8 concurrent threads, and with a
1 % label filter. Recall@10 compares the served top 10 with an exhaustive ranking by the same score
over all N adapters (computed chunk by chunk from the generator: the baseline, timed per query).

    python -m bench.serve --adapters 1000000 --zoo-data-dir DIR   # DIR: a data dir where `zoo train` ran

Prints a table and, on the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHUNK = 50_000
SHARDS = 100


@dataclass
class Source:
    """The real zoo's vectors the synthetic adapters are mixed from."""

    sketches: np.ndarray  # (n, modules·dim), unit blocks
    w2t: np.ndarray  # (n, dim), unit
    tasks: list[str]
    n_modules: int
    sketch_config: dict
    w2t_checkpoint: str
    w2t_config: dict
    noise: float


def load_source(database_url: str, data_dir: Path, noise: float) -> Source:
    from sqlalchemy import select

    from embed.registry import active_embedder, load_embeddings
    from embed.service import resolve_space
    from zoo.db.models import Label
    from zoo.db.session import session_factory

    with session_factory(database_url)() as session:
        space = resolve_space(session, None)
        sketch, w2t = active_embedder(session, space, "module_sketch"), active_embedder(session, space, "w2t")
        if sketch is None or w2t is None or w2t.objective == "contrastive":
            raise SystemExit(
                f"{data_dir}: the bench needs a zoo with module sketches and a supervised W2T: run `zoo embed` and `zoo train`"
            )
        s_ids, s_vecs = load_embeddings(session, sketch)
        w_ids, w_vecs = load_embeddings(session, w2t)
        ids = np.intersect1d(s_ids, w_ids)
        tasks = dict(session.execute(select(Label.adapter_id, Label.value).where(Label.key == "task", Label.source == "given")).all())
        return Source(
            s_vecs[np.searchsorted(s_ids, ids)],
            w_vecs[np.searchsorted(w_ids, ids)],
            [tasks.get(int(i), "") for i in ids],
            len(sketch.config["schema"]["modules"]),
            dict(sketch.config),
            str((data_dir / str(w2t.checkpoint)).resolve()),
            dict(w2t.config),
            noise,
        )


def unit_blocks(x: np.ndarray, n_modules: int) -> np.ndarray:
    blocks = x.reshape(len(x), n_modules, -1)
    return (blocks / np.maximum(np.linalg.norm(blocks, axis=2, keepdims=True), 1e-12)).reshape(len(x), -1).astype(np.float32)


def synthetic_chunk(src: Source, start: int, stop: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sketches, w2t vectors, main parents) of synthetic adapters start..stop-1, the same on every call."""
    rng = np.random.default_rng([seed, start])
    n = stop - start
    a, b = rng.integers(0, len(src.tasks), n), rng.integers(0, len(src.tasks), n)
    u = rng.uniform(0.5, 1.0, (n, 1)).astype(np.float32)
    sk = u * src.sketches[a] + (1 - u) * src.sketches[b] + src.noise * rng.standard_normal((n, src.sketches.shape[1]), dtype=np.float32)
    w = u * src.w2t[a] + (1 - u) * src.w2t[b] + src.noise * rng.standard_normal((n, src.w2t.shape[1]), dtype=np.float32)
    return unit_blocks(sk, src.n_modules), (w / np.linalg.norm(w, axis=1, keepdims=True)).astype(np.float32), a


def chunks(n: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, CHUNK):
        yield start, min(n, start + CHUNK)


def build(src: Source, n: int, work: Path, seed: int) -> dict[str, float]:
    """Write the synthetic space's database and index files under `work` (runs in a child process)."""
    from sqlalchemy import insert

    from embed.engine import index_path
    from embed.index import IVF_FROM, AdapterIndex, ivf_lists
    from zoo.db.models import Adapter, Embedder, Embedding, EmbeddingSpace, Label
    from zoo.db.session import make_engine, upgrade

    t0 = time.perf_counter()
    url = f"sqlite:///{work / 'zoo.db'}"
    upgrade(url)
    engine = make_engine(url)
    base = "synthetic/" + src.sketch_config["schema"]["base_model"]
    with engine.begin() as conn:
        conn.execute(insert(EmbeddingSpace).values(id=1, name=base, base_model=base, schema=src.sketch_config["schema"], version=1))
        conn.execute(
            insert(Embedder).values(
                id=1, space_id=1, method="module_sketch", dim=src.sketches.shape[1], config=src.sketch_config, active=True
            )
        )
        conn.execute(
            insert(Embedder).values(
                id=2,
                space_id=1,
                method="w2t",
                objective="supervised",
                checkpoint=src.w2t_checkpoint,
                dim=src.w2t.shape[1],
                config=src.w2t_config,
                active=True,
            )
        )
    indexes: list[AdapterIndex] = []
    for start, stop in chunks(n):
        sk, w, parent = synthetic_chunk(src, start, stop, seed)
        ids = np.arange(start + 1, stop + 1)
        with engine.begin() as conn:
            conn.execute(
                insert(Adapter),
                [
                    {
                        "id": int(i),
                        "name": f"syn-{i:07d}",
                        "source_uri": f"synthetic://{i}",
                        "base_model": base,
                        "format": "peft",
                        "rank": 8,
                        "canonical_hash": f"{i:064x}",
                        "structure_hash": "0" * 64,
                        "file_sha256": "0" * 64,
                        "size_bytes": 0,
                        "config": {},
                        "file_metadata": {},
                        "extra_tensors": {},
                        "notes": [],
                    }
                    for i in ids.tolist()
                ],
            )
            conn.execute(
                insert(Label),
                [{"adapter_id": int(i), "key": "task", "value": src.tasks[p], "source": "given"} for i, p in zip(ids, parent, strict=True)]
                + [{"adapter_id": int(i), "key": "shard", "value": f"s{i % SHARDS}", "source": "given"} for i in ids.tolist()],
            )
            for embedder_id, vectors in ((1, sk), (2, w)):
                conn.execute(
                    insert(Embedding),
                    [
                        {"adapter_id": int(i), "embedder_id": embedder_id, "vector": v.tobytes(), "version": 1}
                        for i, v in zip(ids, vectors, strict=True)
                    ],
                )
        if not indexes:  # the coarse quantizers are trained on the first 64 adapters a list
            if n >= IVF_FROM:
                sample_sk, sample_w, _ = synthetic_chunk(src, 0, min(n, 64 * ivf_lists(n)), seed)
                indexes = [AdapterIndex.trained_ivf(sample_sk, n), AdapterIndex.trained_ivf(sample_w, n)]
                del sample_sk, sample_w
            else:
                indexes = [AdapterIndex.exact(sk.shape[1]), AdapterIndex.exact(w.shape[1])]
        for index, vectors in zip(indexes, (sk, w), strict=True):
            index.add(ids, vectors)
    db_s = time.perf_counter() - t0
    sample_sk, sample_w, _ = synthetic_chunk(src, 0, min(n, 200), seed)
    for embedder_id, index, sample in zip((1, 2), indexes, (sample_sk, sample_w), strict=True):
        if index.ivf:
            index.tune_nprobe(sample)
        index.save(index_path(work, embedder_id), {"embedder_id": embedder_id, "version": 1})
    return {
        "build_s": time.perf_counter() - t0,
        "database_s": db_s,
        "nprobe": [ix.nprobe for ix in indexes],
        "rerank": [ix.rerank for ix in indexes],
    }  # type: ignore[dict-item]


def _build_in_child(src: Source, n: int, work: Path, seed: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    out.put(build(src, n, work, seed))


def build_or_reuse(src: Source, n: int, work: Path, seed: int, reuse: bool) -> dict:
    """The build's figures: read from `work/build.json` (reuse), or from a build in a child process (so that the
    serving process's memory is its own), then saved there."""
    if reuse:
        return json.loads((work / "build.json").read_text())  # type: ignore[no-any-return]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_build_in_child, args=(src, n, work, seed, out))
    child.start()
    built = out.get()
    child.join()
    (work / "build.json").write_text(json.dumps(built))
    return built  # type: ignore[no-any-return]


def rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def percentiles(times: list[float]) -> tuple[float, float]:
    return float(np.percentile(times, 50) * 1e3), float(np.percentile(times, 99) * 1e3)


def exhaustive_top(
    src: Source, n: int, seed: int, queries: np.ndarray, weight: float, k: int, shards: np.ndarray | None = None
) -> tuple[np.ndarray, float]:
    """Top-k ids of each query by the served score over all N (the baseline), and its time per query;
    with `shards`, each query's over the adapters of its shard only (the filtered baseline)."""
    from embed.similarity import hybrid_score, sketch_module_cosines

    q_sk = np.zeros((len(queries), src.sketches.shape[1]), np.float32)
    q_w = np.zeros((len(queries), src.w2t.shape[1]), np.float32)
    for start, stop in chunks(n):  # the queries' own vectors, as stored
        inside = np.nonzero((queries > start) & (queries <= stop))[0]
        if len(inside):
            sk, w, _ = synthetic_chunk(src, start, stop, seed)
            q_sk[inside], q_w[inside] = sk[queries[inside] - 1 - start], w[queries[inside] - 1 - start]
    t0 = time.perf_counter()
    best_s = np.full((len(queries), 0), -np.inf)
    best_i = np.zeros((len(queries), 0), dtype=np.int64)
    for start, stop in chunks(n):
        sk, w, _ = synthetic_chunk(src, start, stop, seed)
        s = hybrid_score(sketch_module_cosines(q_sk, sk, src.n_modules), q_w @ w.T, weight)
        ids = np.arange(start + 1, stop + 1)
        s[ids[None, :] == queries[:, None]] = -np.inf
        if shards is not None:
            s[ids[None, :] % SHARDS != shards[:, None]] = -np.inf
        all_s = np.concatenate([best_s, s], axis=1)
        all_i = np.concatenate([best_i, np.broadcast_to(ids, s.shape)], axis=1)
        top = np.argpartition(-all_s, k, axis=1)[:, :k]
        best_s, best_i = np.take_along_axis(all_s, top, 1), np.take_along_axis(all_i, top, 1)
    return best_i, (time.perf_counter() - t0) / len(queries)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=100_000)
    p.add_argument("--zoo-data-dir", type=Path, help="data dir of the real zoo (default: $ZOO_DATA_DIR)")
    p.add_argument("--zoo-db", help="its database URL (default: SQLite in the data dir)")
    p.add_argument("--work", type=Path, help="where to build the synthetic space (default: a temporary dir, removed)")
    p.add_argument("--reuse", action="store_true", help="serve the space already built in --work (same --adapters, --seed, --noise)")
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--recall-queries", type=int, default=50)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--noise", type=float, default=0.02, help="per-coordinate noise added to every mixture (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from zoo.config import Settings

    settings = Settings.load(args.zoo_db, args.zoo_data_dir)
    src = load_source(settings.database_url, settings.data_dir, args.noise)
    work = args.work or Path(tempfile.mkdtemp(prefix="zoo-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = serve(src, args, work, build_or_reuse(src, args.adapters, work, args.seed, args.reuse))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(
        f"{result['adapters']} synthetic adapters (from {len(src.tasks)} real ones): built in {result['build_s']:.0f} s, "
        f"loaded in {result['load_s']:.1f} s, nprobe {result['nprobe']}, rerank {result['rerank']}\n"
        f"similar-by-id (hybrid, k = 10): p50 {result['p50_ms']:.2f} ms, p99 {result['p99_ms']:.2f} ms; "
        f"{args.threads} threads p99 {result['p99_ms_8_threads']:.2f} ms ({result['queries_per_s_8_threads']:.0f} queries/s); "
        f"1 % filter p50 {result['p50_ms_filtered_1pct']:.2f} ms, p99 {result['p99_ms_filtered_1pct']:.2f} ms\n"
        f"recall@10 vs exhaustive {result['recall_at_10']:.3f} (1 % filter: {result['recall_at_10_filtered_1pct']:.3f}); "
        f"exhaustive {result['exhaustive_ms_per_query']:.0f} ms/query "
        f"({result['speedup_vs_exhaustive']:.0f}x the served p50); resident memory {result['rss_gb']:.2f} GB"
    )
    print(json.dumps(result))


def serve(src: Source, args: argparse.Namespace, work: Path, built: dict) -> dict[str, object]:
    from embed.engine import Query, QueryEngine
    from zoo.blobs import BlobStore
    from zoo.db.session import session_factory

    sessions = session_factory(f"sqlite:///{work / 'zoo.db'}")
    engine = QueryEngine(sessions, BlobStore(work / "blobs"), work)
    rng = np.random.default_rng(args.seed + 1)
    queries = rng.integers(1, args.adapters + 1, args.queries)
    with sessions() as session:
        space = next(iter(session.execute(__import__("sqlalchemy").text("select name from embedding_space")).scalars()))
        t0 = time.perf_counter()
        engine.space(session, space)
        load_s = time.perf_counter() - t0

    def one(i: int, filters: dict[str, str] | None = None) -> tuple[float, list[int]]:
        with sessions() as session:
            t = time.perf_counter()
            found = engine.similar(session, space, Query(f"syn-{i:07d}", int(i)), 10, filters)
            return time.perf_counter() - t, [r["adapter_id"] for r in found["results"]]

    for i in queries[:20]:  # warm-up
        one(int(i))
    single = [one(int(i)) for i in queries]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.threads) as pool:
        threaded = list(pool.map(lambda i: one(int(i))[0], queries))
    wall = time.perf_counter() - t0
    shards = rng.integers(0, SHARDS, len(queries))
    filtered = [one(int(i), {"shard": f"s{int(j)}"}) for i, j in zip(queries, shards, strict=True)]
    weight = float(engine.w2t(engine.space(sessions(), space).embedders["w2t"]).hybrid_weight)
    rq = queries[: args.recall_queries]
    exact, exhaustive_s = exhaustive_top(src, args.adapters, args.seed, rq, weight, 10)
    recall = float(np.mean([len(set(single[j][1]) & set(exact[j].tolist())) / 10 for j in range(len(rq))]))
    exact_f, _ = exhaustive_top(src, args.adapters, args.seed, rq, weight, 10, shards[: len(rq)])
    recall_f = float(np.mean([len(set(filtered[j][1]) & set(exact_f[j].tolist())) / 10 for j in range(len(rq))]))
    p50, p99 = percentiles([t for t, _ in single])
    f50, f99 = percentiles([t for t, _ in filtered])
    return {
        "adapters": args.adapters,
        "real_adapters": len(src.tasks),
        "p50_ms": round(p50, 3),
        "p99_ms": round(p99, 3),
        "p99_ms_8_threads": round(percentiles(threaded)[1], 3),
        "queries_per_s_8_threads": round(len(queries) / wall, 1),
        "p50_ms_filtered_1pct": round(f50, 3),
        "p99_ms_filtered_1pct": round(f99, 3),
        "recall_at_10": round(recall, 4),
        "recall_at_10_filtered_1pct": round(recall_f, 4),
        "exhaustive_ms_per_query": round(exhaustive_s * 1e3, 1),
        "speedup_vs_exhaustive": round(exhaustive_s * 1e3 / p50, 1),
        "rss_gb": round(rss_gb(), 3),
        "build_s": round(built["build_s"], 1),
        "database_s": round(built["database_s"], 1),
        "load_s": round(load_s, 2),
        "nprobe": built["nprobe"],
        "rerank": built.get("rerank"),
        "hybrid_weight": weight,
        "synthetic": True,
    }


if __name__ == "__main__":
    main()
