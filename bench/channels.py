"""Benchmark: the exact similarity channels (zoo/domain/channels.py) of many adapters against many, beside module cosine.

Builds a ModuleStack of --adapters random adapters (default 2,000 of 8 modules, d_out = d_in = 768, rank 8: orthonormal
U and V, singular values decaying at a random rate, a --missing fraction of modules absent) and scores its first
--queries rows against all of it, one channel at a time, then the whole bank in one call, and the channel metric's
atoms per module group with dW's (`bank_atoms`, what `zoo train` fits the metric on), in one process; then the
centred input Gram (zoo/domain/centred_gram.py): its reference fitted on every adapter (`gram_reference`), and its
scores on that reference (`centred_gram`); last the four exact scores `zoo train` weighs (dW, module, input Gram and
centred input Gram cosine) each on its own (`exact_apart`) and in one pass over the modules (`exact_one_pass`). Per
row: seconds (the median of --repeats runs), the ratio to module cosine's time in the same run, and the peak of the
memory numpy allocated during the call (tracemalloc: temporaries and the result, not the stack). Prints a table and,
on the last line, one JSON object. BLAS threads are numpy's default (set OMP_NUM_THREADS to pin them).

    python -m bench.channels --adapters 2000 --queries 2000
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from zoo.domain.centred_gram import CENTRED_GRAM, fit_gram_reference
from zoo.domain.channel_metric import bank_matrices
from zoo.domain.channels import CHANNELS, channel_matrices
from zoo.domain.exact_scores import EXACT_SCORES, exact_cosines, exact_matrices
from zoo.domain.similarity import ModuleStack


def random_stack(n: int, modules: int, dim: int, rank: int, missing: float, seed: int) -> ModuleStack:
    """n adapters' factors as a ModuleStack with no dense modules, built in numpy (one batched QR per module and side)."""
    rng = np.random.default_rng(seed)
    norms: dict[str, np.ndarray] = {}
    factors: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for m in range(modules):
        name = f"layers.{m // 4}.{('q', 'k', 'v', 'o')[m % 4]}_proj"
        present = rng.random(n) >= missing
        U, V = (np.linalg.qr(rng.standard_normal((n, dim, rank), dtype=np.float32))[0].transpose(0, 2, 1) for _ in range(2))
        S = np.exp(-np.arange(rank)[None, :] * rng.uniform(0.05, 0.6, (n, 1)))
        w = (S / np.linalg.norm(S, axis=1, keepdims=True)).astype(np.float32)
        mask = present[:, None, None]
        factors[name] = (np.ascontiguousarray(U * mask), np.ascontiguousarray(V * mask), w * present[:, None])
        norms[name] = (rng.lognormal(0.0, 0.5, n) * present).astype(np.float32)
    return ModuleStack(n, norms, {}, factors)


def timed(call: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median seconds, peak MiB numpy allocated during a call) of `call`."""
    times, peak = [], 0
    for _ in range(repeats):
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
        peak = max(peak, tracemalloc.get_traced_memory()[1] - base)
    return statistics.median(times), peak / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=2000)
    p.add_argument("--queries", type=int, default=None, help="query rows (the first of the gallery; default: all)")
    p.add_argument("--modules", type=int, default=8)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--missing", type=float, default=0.1, help="fraction of (adapter, module) pairs absent")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    nq = args.queries or args.adapters

    t0 = time.perf_counter()
    gallery = random_stack(args.adapters, args.modules, args.dim, args.rank, args.missing, args.seed)
    queries = gallery.take(np.arange(nq))
    build_s = time.perf_counter() - t0
    stack_mb = sum(v.nbytes for v in gallery.arrays().values()) / 2**20

    tracemalloc.start()
    rows: dict[str, dict[str, float]] = {}
    calls: dict[str, Callable[[], object]] = {c: functools.partial(channel_matrices, gallery, queries, (c,)) for c in CHANNELS}
    calls["bank"] = functools.partial(channel_matrices, gallery, queries, CHANNELS)
    calls["bank_atoms"] = functools.partial(bank_matrices, gallery, queries)
    reference = fit_gram_reference(gallery, np.arange(args.adapters))
    calls["gram_reference"] = functools.partial(fit_gram_reference, gallery, np.arange(args.adapters))
    calls["centred_gram"] = functools.partial(exact_cosines, gallery, queries, CENTRED_GRAM, reference)
    exact = (*EXACT_SCORES, CENTRED_GRAM)
    calls["exact_apart"] = lambda: [exact_cosines(gallery, queries, s, reference) for s in exact]
    calls["exact_one_pass"] = functools.partial(exact_matrices, gallery, queries, exact, reference)
    for name, call in calls.items():
        seconds, peak = timed(call, args.repeats)
        rows[name] = {"s": seconds, "peak_mib": peak}
    tracemalloc.stop()
    module_s = rows["module"]["s"]
    for row in rows.values():
        row["vs_module"] = row["s"] / module_s

    print(f"{nq} × {args.adapters} adapters, {args.modules} modules, d = {args.dim}, rank {args.rank}; stack {stack_mb:.0f} MiB")
    print(f"{'channel':<16} {'seconds':>9} {'× module':>9} {'peak MiB':>9}")
    for c, row in rows.items():
        print(f"{c:<16} {row['s']:9.2f} {row['vs_module']:9.2f} {row['peak_mib']:9.0f}")
    result = {
        "queries": nq,
        "adapters": args.adapters,
        "modules": args.modules,
        "dim": args.dim,
        "rank": args.rank,
        "cpus": os.cpu_count(),
        "build_s": round(build_s, 2),
        "stack_mib": round(stack_mb, 1),
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "channels": {c: {k: round(v, 3) for k, v in row.items()} for c, row in rows.items()},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
