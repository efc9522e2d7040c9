"""Benchmark: FAISS search vs a brute-force numpy search, at 10k and 100k synthetic vectors; and, on a real zoo, the
first stage of input_gram search.

For each size: query latency p50/p99 of the exact FAISS index (IndexIDMap2 over IndexFlatIP),
of IVF (float16 codes, nprobe tuned to the recall goal), and of numpy brute force (the baseline,
measured in the same run), and recall@10 of each index against brute force. Vectors have the W2T embedding's dimension (64) by default.

With `--zoo-data-dir DIR` (a data dir where `zoo embed` ran, with its module store): every adapter queries the others,
and the first stage of `--method input_gram` is scored by its recall@10 of the exact input-Gram top 10 (from the module
store, zoo.domain.channels.exact_cosines): the share of the exact top 10 among the candidates, which the exact re-rank
then orders. Candidates: the module sketch index's nearest (the baseline: what input_gram search took before the
input-Gram sketch index), the input-Gram sketch index's, and the union of both, at pools of --pools nearest each
(the engine's is embed.serving.index.CANDIDATES); with --widths, input-Gram sketches of other probe counts per module,
computed from the blobs. Per pool: each recall, the ratio to the baseline's, and the paired per-query gain with a 95 %
t interval. Everything in one process and one run.

    python -m bench.search --zoo-data-dir DATA --widths 64

Prints a table and, on the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from embed.serving.exact_search import brute_force, normalize, recall_at_k
from embed.serving.index import AdapterIndex


def latencies(fn, queries: np.ndarray) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    times = []
    for q in queries:
        t0 = time.perf_counter()
        fn(q[None, :])
        times.append(time.perf_counter() - t0)
    return float(np.percentile(times, 50) * 1e3), float(np.percentile(times, 99) * 1e3)


def nearest(vectors: np.ndarray, depth: int) -> np.ndarray:
    """(n, depth) rows of each row's nearest others by cosine (a flat index's first stage), itself left out."""
    v = normalize(vectors)
    sims = v @ v.T
    np.fill_diagonal(sims, -np.inf)
    return np.argsort(-sims, axis=1, kind="stable")[:, :depth]


def t_interval(x: np.ndarray) -> tuple[float, float]:
    """95 % t interval of the mean of x."""
    from scipy import stats

    half = float(stats.t.ppf(0.975, len(x) - 1) * x.std(ddof=1) / np.sqrt(len(x))) if len(x) > 1 else float("nan")
    return float(x.mean()) - half, float(x.mean()) + half


def zoo_first_stage(data_dir: Path, pools: list[int], widths: list[int], k: int) -> dict[str, object]:
    """Recall@k of the exact input-Gram top k among each first stage's candidates, every adapter of the zoo's only space
    a query (see the module doc)."""
    from embed.data.dataset import load_adapters
    from embed.data.types import SpaceSchema
    from embed.serving.module_store import module_store_path, read_module_store
    from embed.serving.resources import resolve_space
    from embed.serving.search_methods import GRAM, SKETCH
    from zoo.config import Settings
    from zoo.domain.channels import channel_sketches
    from zoo.domain.exact_scores import exact_cosines
    from zoo.store.blobs import BlobStore
    from zoo.store.embedders import serving_embedders
    from zoo.store.embeddings import load_embeddings
    from zoo.store.session import session_factory

    settings = Settings.load(None, data_dir)
    with session_factory(settings.database_url)() as session:
        space = resolve_space(session, None)
        serving = serving_embedders(session, space.id)
        if GRAM not in serving:
            raise SystemExit(f"{data_dir}: no {GRAM} embedder: run `zoo embed`")
        stored = {kind: load_embeddings(session, serving[kind]) for kind in (SKETCH, GRAM)}
        have = read_module_store(module_store_path(settings.data_dir, space.id))
        if have is None:
            raise SystemExit(f"{data_dir}: no module store: run `zoo embed` (within ZOO_MODULE_STORE_BYTES)")
        ids, stack = have[0], have[1]
        names = SpaceSchema.from_dict(serving[GRAM].config["schema"]).module_names
        extra = {}
        if widths:
            adapters = {a.id: a.factors for a in load_adapters(session, BlobStore(settings.blob_dir), space.base_model, ids.tolist())}
            extra = {f"gram_{w}": channel_sketches([adapters[int(i)] for i in ids], names, w, "input_gram") for w in widths}
    t0 = time.perf_counter()
    exact = exact_cosines(stack, stack, "input_gram")
    exact_s = time.perf_counter() - t0
    np.fill_diagonal(exact, -np.inf)
    truth = np.argsort(-exact, axis=1, kind="stable")[:, :k]
    rows = {int(i): j for j, i in enumerate(ids.tolist())}

    def aligned(kind: str) -> np.ndarray:
        found, vectors = stored[kind]
        out = np.zeros((len(ids), vectors.shape[1]), np.float32)
        out[[rows[int(i)] for i in found.tolist()]] = vectors
        return out

    vectors = {"module_sketch": aligned(SKETCH), "input_gram_sketch": aligned(GRAM), **extra}
    depth = max(pools)
    near = {name: nearest(v, depth) for name, v in vectors.items()}
    out: dict[str, object] = {
        "adapters": len(ids),
        "k": k,
        "dims": {name: int(v.shape[1]) for name, v in vectors.items()},
        "exact_input_gram_s": round(exact_s, 3),
    }
    for pool in pools:
        per_query: dict[str, np.ndarray] = {}
        for name in near:
            per_query[name] = np.array([len(set(near[name][q, :pool]) & set(truth[q])) / k for q in range(len(ids))])
        for name in [n for n in near if n != "module_sketch"]:
            per_query[f"{name}+module_sketch"] = np.array(
                [len((set(near[name][q, :pool]) | set(near["module_sketch"][q, :pool])) & set(truth[q])) / k for q in range(len(ids))]
            )
        base = per_query["module_sketch"]
        row = {}
        for name, recall in per_query.items():
            low, high = t_interval(recall - base)
            row[name] = {
                "recall": round(float(recall.mean()), 4),
                "ratio_to_module_sketch": round(float(recall.mean() / max(base.mean(), 1e-12)), 3),
                "gain": round(float((recall - base).mean()), 4),
                "gain_95": [round(low, 4), round(high, 4)],
            }
        out[f"pool_{pool}"] = row
        print(
            f"pool {pool}: "
            + "; ".join(
                f"{name} {r['recall']:.3f} ({r['ratio_to_module_sketch']:.2f}x, {r['gain']:+.3f} [{r['gain_95'][0]:+.3f}, "
                f"{r['gain_95'][1]:+.3f}])"
                for name, r in row.items()
            )
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("-k", type=int, default=10)
    p.add_argument("--zoo-data-dir", type=Path, help="measure input_gram's first stage on this real zoo instead")
    p.add_argument("--pools", type=int, nargs="+", default=[10, 20, 50, 100, 200], help="candidates per index (with --zoo-data-dir)")
    p.add_argument("--widths", type=int, nargs="*", default=[], help="input-Gram sketches of these probes per module too")
    args = p.parse_args()
    if args.zoo_data_dir is not None:
        print(json.dumps(zoo_first_stage(args.zoo_data_dir, args.pools, args.widths, args.k)))
        return
    rng = np.random.default_rng(0)
    out: dict[str, object] = {"dim": args.dim, "k": args.k}
    for n in args.sizes:
        # clustered vectors, like embeddings of adapters of a few hundred tasks
        centers = rng.standard_normal((max(10, n // 100), args.dim)).astype(np.float32)
        vectors = normalize(centers[rng.integers(0, len(centers), n)] + 0.5 * rng.standard_normal((n, args.dim)).astype(np.float32))
        ids = np.arange(1, n + 1, dtype=np.int64)
        queries = normalize(
            vectors[rng.integers(0, n, args.queries)] + 0.1 * rng.standard_normal((args.queries, args.dim)).astype(np.float32)
        )
        t0 = time.perf_counter()
        flat = AdapterIndex.build(ids, vectors, ivf=False)
        t_flat = time.perf_counter() - t0
        t0 = time.perf_counter()
        ivf = AdapterIndex.build(ids, vectors, ivf=True)
        t_ivf = time.perf_counter() - t0
        _, exact = brute_force(ids, vectors, queries, args.k)
        bf50, bf99 = latencies(lambda q, ids=ids, vectors=vectors: brute_force(ids, vectors, q, args.k), queries)
        fl50, fl99 = latencies(lambda q, index=flat: index.search(q, args.k), queries)
        hn50, hn99 = latencies(lambda q, index=ivf: index.search(q, args.k), queries)
        row = {
            "brute_force_p50_ms": round(bf50, 3),
            "brute_force_p99_ms": round(bf99, 3),
            "flat_p50_ms": round(fl50, 3),
            "flat_p99_ms": round(fl99, 3),
            "ivf_p50_ms": round(hn50, 3),
            "ivf_p99_ms": round(hn99, 3),
            "flat_speedup_p50": round(bf50 / fl50, 2),
            "ivf_speedup_p50": round(bf50 / hn50, 2),
            "flat_recall@10": recall_at_k(flat.search(queries, args.k)[1], exact),
            "ivf_recall@10": recall_at_k(ivf.search(queries, args.k)[1], exact),
            "build_flat_s": round(t_flat, 2),
            "build_ivf_s": round(t_ivf, 2),
        }
        out[str(n)] = row
        print(
            f"n={n}: brute force p50 {bf50:.3f} ms | flat p50 {fl50:.3f} ms ({row['flat_speedup_p50']}x, "
            f"recall {row['flat_recall@10']:.3f}) | ivf p50 {hn50:.3f} ms ({row['ivf_speedup_p50']}x, "
            f"recall {row['ivf_recall@10']:.3f}); p99 {bf99:.2f}/{fl99:.2f}/{hn99:.2f} ms"
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
