"""Benchmark: the engine's exact stage with its module store's dense-module SVDs kept (embed/serving/dense_svd.py) against
factoring every candidate's dense modules on every query (the baseline: what the engine did before), on a real zoo.

In a data dir where `zoo embed` ran (its module store) and, for the channel metric, `zoo train` (a checkpoint with
`channel_metrics`), each of --queries stored adapters queries every other one, as `embed.serving.engine` scores the candidates:
the exact input Gram (`exact_cosines`) and each channel metric the checkpoint holds (`ChannelMetric.between`), once
from the store's rows without their SVDs (`ModuleStack.take`, the baseline) and once with them (`ModuleStore.take`),
alternating query by query, in one process and one run. The first cached query factors every row (reported apart);
per score the median seconds per query of each, their ratio, and the largest difference of the scores (0: the same).

    python -m bench.dense_svd --zoo-data-dir DATA --queries 8

Prints a line per score and, on the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from embed.serving.engine import QueryEngine
from embed.serving.search_methods import W2T
from embed.w2t.checkpoint import channel_metrics_of, checkpoint_meta
from zoo.config import Settings
from zoo.domain.exact_scores import exact_cosines
from zoo.store.blobs import BlobStore
from zoo.store.session import session_factory


def run(data_dir: Path, queries: int) -> dict[str, object]:
    settings = Settings.load(None, data_dir)
    engine = QueryEngine(session_factory(settings.database_url), BlobStore(settings.blob_dir), data_dir)
    with session_factory(settings.database_url)() as session:
        from zoo.store.models import EmbeddingSpace

        (space,) = session.query(EmbeddingSpace.name).all()
        state = engine.space(session, space[0])
    store = state.modules
    if store is None:
        raise SystemExit(f"{data_dir}: the space has no module store: run `zoo embed`")
    scores = {"input_gram": lambda g, q: exact_cosines(g, q, "input_gram")}
    if W2T in state.embedders:
        metrics = channel_metrics_of(checkpoint_meta(data_dir / str(state.embedders[W2T].checkpoint)))
        scores.update({name: m.between for name, m in sorted(metrics.items())})
    ids = sorted(store.rows)
    t0 = time.perf_counter()
    store.take(ids)  # the first query's cost: every row factored
    first = time.perf_counter() - t0
    out: dict[str, object] = {"adapters": len(ids), "dense_modules": len(store.dense), "first_factoring_s": round(first, 3)}
    for name, score in scores.items():
        before, after, gap = [], [], 0.0
        for q in ids[:queries]:
            others = [i for i in ids if i != q]
            t0 = time.perf_counter()
            old = score(store.stack.take([store.rows[i] for i in others]), store.stack.take([store.rows[q]]))
            t1 = time.perf_counter()
            new = score(store.take(others), store.take([q]))
            t2 = time.perf_counter()
            before.append(t1 - t0)
            after.append(t2 - t1)
            gap = max(gap, float(np.abs(old - new).max()))
        b, a = statistics.median(before), statistics.median(after)
        out[name] = {"baseline_s": round(b, 4), "cached_s": round(a, 4), "speedup": round(b / a, 1), "max_abs_difference": gap}
        print(f"{name}: {b:.3f} s a query factoring every candidate, {a:.3f} s with SVDs kept ({b / a:.1f}x); largest difference {gap:g}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zoo-data-dir", type=Path, required=True)
    p.add_argument("--queries", type=int, default=8)
    args = p.parse_args()
    result = run(args.zoo_data_dir, args.queries)
    print(f"first query (every row factored): {result['first_factoring_s']} s")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
