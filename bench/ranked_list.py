"""How long full text's list of a search by meaning takes (zoo.store.catalog.ranked_ids) with its other words looked up
first where the last word is a short prefix (zoo.store.search_text.other_words_found) against without (what it did
before), on bench.catalog's catalog and sentences, alternated query by query so that both see the same load; the ids
must agree.

    python -m bench.ranked_list --db postgresql://postgres@127.0.0.1:5432/zoo_bench_catalog --queries 300
    python -m bench.ranked_list --db sqlite:///FILE   # SQLite: the words looked up in Python, the search skipped

Build the catalog first (python -m bench.catalog). Prints per sentence the medians, and on the last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import numpy as np

from bench.catalog import SENTENCES, percentile


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db", default=os.environ.get("ZOO_BENCH_CATALOG_URL", "postgresql://postgres@127.0.0.1:5432/zoo_bench_catalog"))
    p.add_argument("--queries", type=int, default=300)
    args = p.parse_args()
    from zoo.store import search_text
    from zoo.store.catalog import ranked_ids
    from zoo.store.session import session_factory

    sessions = session_factory(args.db)
    short = search_text.SHORT_PREFIX_CHARS
    rng = random.Random(0)
    times: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    for i in range(args.queries + 6):  # the first of each sentence not timed (statements planned, pages read)
        q = SENTENCES[i] if i < 6 else rng.choice(SENTENCES)
        found = {}
        for way in ("before", "after") if i % 2 else ("after", "before"):
            search_text.SHORT_PREFIX_CHARS = short if way == "after" else -1  # -1: no prefix that short, nothing looked up first
            with sessions() as session:
                t = time.perf_counter()
                found[way] = ranked_ids(session, q, {}, 100)
                if i >= 6:
                    times[way].setdefault(q, []).append(time.perf_counter() - t)
        search_text.SHORT_PREFIX_CHARS = short
        assert found["before"] == found["after"], q
    result: dict[str, object] = {"queries": args.queries, "load_1min": round(os.getloadavg()[0], 2)}
    for q in SENTENCES:
        before, after = (np.median(times[w][q]) * 1e3 for w in ("before", "after"))
        print(f"{q:40s} median before {before:6.2f} ms  after {after:6.2f} ms  ({after / before:.3f}x)")
        result[q] = {"before_ms": round(before, 2), "after_ms": round(after, 2)}
    every = {way: [t for ts in times[way].values() for t in ts] for way in ("before", "after")}
    tails = {way: {f"p{q}_ms": round(percentile(every[way], q), 2) for q in (50, 99)} for way in every}
    ratio = {k: round(tails["after"][k] / tails["before"][k], 3) for k in ("p50_ms", "p99_ms")}
    print(f"all sentences: p50 {tails['before']['p50_ms']} -> {tails['after']['p50_ms']} ms ({ratio['p50_ms']}x), ", end="")
    print(f"p99 {tails['before']['p99_ms']} -> {tails['after']['p99_ms']} ms ({ratio['p99_ms']}x)")
    print(json.dumps({**result, **tails, "ratio": ratio}))


if __name__ == "__main__":
    main()
