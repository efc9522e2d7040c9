"""How long a search by meaning takes to encode its sentence: sentence-transformers' `encode` (what queries used) against
the encoder's modules called directly (`embed.serving.text_index.encode_query`, what they use now), on distinct
queries (no cache), alternated query by query so that both see the same load; the vectors must agree.

    python -m bench.query_encoder --queries 300
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

WORDS = [
    "classify",
    "handwritten",
    "digits",
    "rotated",
    "images",
    "noise",
    "sentiment",
    "movie",
    "reviews",
    "watercolor",
    "style",
    "topic",
    "documents",
    "code",
    "python",
    "networking",
    "files",
    "text",
    "numbers",
    "testing",
    "shapes",
    "stripes",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2, help="torch's thread count in the process (a query runs on one)")
    args = parser.parse_args()

    import torch

    from embed.serving import text_index

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    queries = [" ".join(rng.choice(WORDS, size=int(rng.integers(3, 10)))) + f" {i}" for i in range(args.queries)]
    for q in queries[:5]:  # warm up: the model loaded, the first passes' allocations made
        text_index.encode([q], threads=text_index.QUERY_THREADS)
        text_index.encode_query(q)
    seconds: dict[str, list[float]] = {"encode": [], "encode_query": []}
    worst = 1.0
    for q in queries:
        started = time.perf_counter()
        a = text_index.encode([q], threads=text_index.QUERY_THREADS)[0]
        seconds["encode"].append(time.perf_counter() - started)
        started = time.perf_counter()
        b = text_index.encode_query(q)
        seconds["encode_query"].append(time.perf_counter() - started)
        worst = min(worst, float(a @ b))
    out: dict[str, object] = {
        k: {f"p{p}_ms": round(1000 * float(np.percentile(v, p)), 2) for p in (50, 90, 99)} for k, v in seconds.items()
    }
    out["ratio_p50"] = round(float(np.percentile(seconds["encode_query"], 50) / np.percentile(seconds["encode"], 50)), 3)
    out["ratio_p99"] = round(float(np.percentile(seconds["encode_query"], 99) / np.percentile(seconds["encode"], 99)), 3)
    out["paired_median_ratio"] = round(float(np.median(np.divide(seconds["encode_query"], seconds["encode"]))), 3)
    out["least_cosine"] = round(worst, 6)
    out["load"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
