"""Benchmark: the exact re-ranking step of `zoo search` (one query against a pool of candidates by
module cosine), stacked and batched (embed/similarity.py) vs a per-pair loop over modules with
zoo.canonical.inner_product, on synthetic canonical adapters of a chosen module shape.

Prints a table and, on the last line, one JSON object (p50 ms of each and the ratio, and the
largest difference between the two, which must be ~0).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import numpy as np
import torch

from embed.similarity import module_cosine_matrix
from zoo.canonical import CanonicalFactors, canonicalize, frobenius_norm_sq, inner_product


def synthetic(n: int, modules: int, out: int, inp: int, max_rank: int, seed: int = 0) -> list[dict[str, CanonicalFactors]]:
    gen = torch.Generator().manual_seed(seed)
    adapters = []
    for _ in range(n):
        factors = {}
        for m in range(modules):
            r = int(torch.randint(1, max_rank + 1, (1,), generator=gen))
            factors[f"layers.{m}.proj"] = canonicalize(torch.randn(r, inp, generator=gen), torch.randn(out, r, generator=gen))
        adapters.append(factors)
    return adapters


def per_pair(query: dict[str, CanonicalFactors], pool: list[dict[str, CanonicalFactors]]) -> np.ndarray:
    """The baseline: module by module, pair by pair."""
    scores = []
    for other in pool:
        shared = [n for n in query if n in other]
        cos = [inner_product(query[n], other[n]) / math.sqrt(frobenius_norm_sq(query[n]) * frobenius_norm_sq(other[n])) for n in shared]
        scores.append(sum(cos) / len(cos) if cos else 0.0)
    return np.array(scores)


def p50_ms(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool", type=int, default=200, help="candidates per query (zoo search uses 200)")
    p.add_argument("--modules", type=int, default=24)
    p.add_argument("--shape", default="768x768", help="OUTxIN of every module")
    p.add_argument("--rank", type=int, default=16, help="largest rank (ranks are drawn from 1..RANK)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    out, inp = (int(x) for x in args.shape.split("x"))
    adapters = synthetic(args.pool + 1, args.modules, out, inp, args.rank)
    query, pool = adapters[0], adapters[1:]
    batched = module_cosine_matrix([query], pool)[0]
    looped = per_pair(query, pool)
    result = {
        "pool": args.pool,
        "modules": args.modules,
        "shape": args.shape,
        "max_rank": args.rank,
        "batched_p50_ms": round(p50_ms(lambda: module_cosine_matrix([query], pool), args.repeats), 2),
        "per_pair_p50_ms": round(p50_ms(lambda: per_pair(query, pool), args.repeats), 2),
        "max_abs_diff": float(np.abs(batched - looped).max()),
    }
    result["speedup"] = round(result["per_pair_p50_ms"] / result["batched_p50_ms"], 2)
    for key, value in result.items():
        print(f"{key:>16}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
