"""Benchmark: FAISS search vs a brute-force numpy search, at 10k and 100k synthetic vectors.

For each size: query latency p50/p99 of the exact FAISS index (IndexIDMap2 over IndexFlatIP),
of IVF (float16 codes, nprobe tuned to the recall goal), and of numpy brute force (the baseline,
measured in the same run), and recall@10 of each index against brute force. Vectors have the W2T embedding's dimension (64) by default.
Prints a table and, on the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from embed.index import AdapterIndex, brute_force, normalize, recall_at_k


def latencies(fn, queries: np.ndarray) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    times = []
    for q in queries:
        t0 = time.perf_counter()
        fn(q[None, :])
        times.append(time.perf_counter() - t0)
    return float(np.percentile(times, 50) * 1e3), float(np.percentile(times, 99) * 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("-k", type=int, default=10)
    args = p.parse_args()
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
