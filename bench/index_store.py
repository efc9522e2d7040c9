"""Benchmark: what an IVF index's store (float16 or 8-bit, embed/serving/index_rows.py `trained_store`) does to cosines and to a top 10.

On a real zoo's module and input-Gram sketches, mixed into `--adapters` synthetic ones as `bench.serve` mixes them,
the first `--queries` are searched by plain cosine against all, once by the float32 vectors and once by each store's
decoded copies (trained on the first 20,000, as an index trains on a sample). Reported per sketch and store: the
cosine error's standard deviation and maximum, the share of the exact top 10 in the store's own top 10 and in its 200
nearest (a first stage's candidates), and the median gaps between a query's 10th and 11th and 10th and 50th neighbours.

    python -m bench.index_store --zoo-data-dir ~/.cache/zoo-bench-serve/llama3-8b-100x2-layers-all-e10-m1/data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zoo-data-dir", type=Path, required=True, help="a zoo's data dir where `zoo embed` wrote both sketches")
    p.add_argument("--adapters", type=int, default=50_000)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--noise", type=float, default=0.02)
    args = p.parse_args()

    from bench.serve import Source, _zoo_vectors, synthetic_chunk, synthetic_gram
    from embed.serving.exact_search import normalize, recall_at_k
    from embed.serving.index_rows import STORE_TYPES, trained_store
    from embed.serving.search_methods import GRAM, SKETCH

    url = f"sqlite:///{args.zoo_data_dir / 'zoo.db'}"
    sketches, tasks, sketch_embedder = _zoo_vectors(url, args.zoo_data_dir, SKETCH)
    grams, _, gram_embedder = _zoo_vectors(url, args.zoo_data_dir, GRAM)
    names = sorted(sketches)
    n_modules = len(sketch_embedder.config["schema"]["modules"])  # type: ignore[attr-defined]
    src = Source(
        sketches=np.stack([sketches[n] for n in names]),
        w2t=np.ones((len(names), 1), np.float32),  # not mixed here
        tasks=[tasks.get(n, "") for n in names],
        n_modules=n_modules,
        sketch_config=sketch_embedder.config,  # type: ignore[attr-defined]
        w2t_checkpoint="",
        w2t_config={},
        noise=args.noise,
        gram=np.stack([grams[n] for n in names]),
        gram_config=gram_embedder.config,  # type: ignore[attr-defined]
    )
    results = []
    for method, vectors in ((SKETCH, synthetic_chunk(src, 0, args.adapters, 0)[0]), (GRAM, synthetic_gram(src, 0, args.adapters, 0))):
        v = normalize(vectors)
        q = v[: args.queries]
        exact = q @ v.T
        top = np.sort(exact, axis=1)[:, ::-1]  # the query itself first
        exact_top = np.argsort(-exact, axis=1, kind="stable")[:, 1:11]
        for store in STORE_TYPES:
            index = trained_store(v[:20_000], store)
            scores = q @ index.sa_decode(index.sa_encode(v)).T
            order = np.argsort(-scores, axis=1, kind="stable")
            error = scores - exact
            row = {
                "sketch": method,
                "dim": v.shape[1],
                "store": store,
                "error_sd": float(error.std()),
                "error_max": float(np.abs(error).max()),
                "recall_at_10": recall_at_k(order[:, 1:11], exact_top),
                "top10_in_200": recall_at_k(order[:, 1:201], exact_top),
                "gap_10th_11th": float(np.median(top[:, 10] - top[:, 11])),
                "gap_10th_50th": float(np.median(top[:, 10] - top[:, 50])),
            }
            results.append(row)
            print(
                f"{method} ({row['dim']} dims) {store}: cosine error sd {row['error_sd']:.2e}, max {row['error_max']:.2e}; "
                f"recall@10 of the exact top 10 {row['recall_at_10']:.3f}, its 200 nearest hold {row['top10_in_200']:.3f}; "
                f"median gap 10th-11th {row['gap_10th_11th']:.2e}, 10th-50th {row['gap_10th_50th']:.2e}",
                flush=True,
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
