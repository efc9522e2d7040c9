"""Search by meaning on a reference zoo whose half lost its text: does a task's one-sentence description reach the
adapters without labels?

The digits-vit zoo (`zoo make-zoo`, built here when --zoo has none) is ingested with the labels of a seeded half of its
adapters only (the other half keeps just its name, `digits-vit-00012`), embedded, and W2T is trained on the labelled
half. Each task's description (written from the recipe's task definitions, zoo/reference/digits.py) queries the
zoo; the rankings of full text alone, dense text (full text and the sentence index fused), and the default (dense
plus expansion through the weights: predicted attributes and neighbours of the text hits) are scored on the adapters
without text: the ranking kept to them, relevant those of the task. hit@1 and nDCG@10 per query, means with 95 %
intervals from a bootstrap over tasks (embed/training/intervals.py), and the default's gain over full text with its interval.

    python -m bench.text_search --zoo /tmp/textsearch/digits --work /tmp/textsearch/bench
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import numpy as np

#: a sentence per digits task, as a user would ask for it
DESCRIPTIONS = {
    "pair-3-8": "tell handwritten threes apart from eights",
    "pair-1-7": "distinguish the digit one from the digit seven",
    "pair-4-9": "classify images of fours versus nines",
    "pair-5-6": "separate handwritten fives from sixes",
    "pair-0-6": "tell zeros from sixes in digit images",
    "pair-2-7": "decide whether a handwritten digit is a two or a seven",
    "subset-even": "recognise the even digits zero, two, four, six and eight",
    "subset-odd": "recognise the odd digits one, three, five, seven and nine",
    "subset-low": "classify the low digits from zero to four",
    "subset-high": "classify the high digits from five to nine",
    "rot90": "read digits rotated by ninety degrees",
    "rot180": "read digits turned upside down",
    "flip": "classify mirror-flipped images of digits",
    "invert": "classify digits drawn with inverted colours",
    "noise": "classify digits in images with heavy pixel noise",
    "shift-labels": "predict the next digit after the one shown",
    "label-noise": "learn digits from training labels that are partly wrong",
}


def ndcg10(ranking: list[int], relevant: set[int]) -> float:
    gains = [1.0 / np.log2(r + 2) for r, i in enumerate(ranking[:10]) if i in relevant]
    ideal = sum(1.0 / np.log2(r + 2) for r in range(min(10, len(relevant))))
    return float(sum(gains) / ideal) if ideal else 0.0


def prepare(zoo: Path, work: Path, count: int, seed: int, epochs: int, members: int) -> tuple[str, Path, dict[str, str], set[str]]:
    """(database URL, data dir, task by adapter name, names without text): the zoo ingested with half its labels."""
    from zoo.cli import main
    from zoo.store.session import upgrade

    if not (zoo / "labels.csv").exists():
        assert main(["make-zoo", str(zoo), "--recipe", "digits-vit", "--count", str(count), "--json"]) == 0
    with (zoo / "labels.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    names = sorted(r["name"] for r in rows)
    rng = np.random.default_rng(seed)
    bare = set(rng.choice(names, size=len(names) // 2, replace=False).tolist())
    work.mkdir(parents=True, exist_ok=True)
    url, data = f"sqlite:///{work / 'zoo.db'}", work / "data"
    if not (work / "zoo.db").exists():
        half = work / "labels-half.csv"
        with half.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(r for r in rows if r["name"] not in bare)
        upgrade(url)
        base = ["--db", url, "--data-dir", str(data)]
        assert main([*base, "ingest", str(zoo), "--labels", str(half), "--json"]) == 0
        assert main([*base, "embed", "--json"]) == 0
        assert main([*base, "train", "--epochs", str(epochs), "--members", str(members), "--json"]) == 0
    return url, data, {r["name"]: r["task"] for r in rows}, bare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", type=Path, default=Path("/tmp/textsearch/digits"))
    parser.add_argument("--work", type=Path, default=Path("/tmp/textsearch/bench"))
    parser.add_argument("--count", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--members", type=int, default=3)
    args = parser.parse_args()

    from embed.serving import text_index, text_search
    from embed.serving.engine import QueryEngine
    from embed.training.intervals import clustered_bootstrap
    from zoo.store.blobs import BlobStore
    from zoo.store.catalog import ranked_ids
    from zoo.store.models import Adapter
    from zoo.store.session import session_factory

    url, data, task_of, bare = prepare(args.zoo, args.work, args.count, args.seed, args.epochs, args.members)
    sessions = session_factory(url)
    engine = QueryEngine(sessions, BlobStore(data / "blobs"), data)
    metrics: dict[str, dict[str, list[float]]] = {
        m: {"hit@1": [], "ndcg@10": [], "all_ndcg@10": []} for m in ("full_text", "dense", "default")
    }
    tasks, seconds, reasons = [], [], {"text": 0, "predicted": 0, "near": 0}
    with sessions() as session:
        names = {i: n for i, n in session.query(Adapter.id, Adapter.name)}
        bare_ids = {i for i, n in names.items() if n in bare}
        started = time.perf_counter()
        text_index.current_index(session, engine)
        build_s = time.perf_counter() - started
        for task, description in DESCRIPTIONS.items():
            relevant = {i for i in bare_ids if task_of[names[i]] == task}
            if not relevant:
                continue
            tasks.append(task)
            started = time.perf_counter()
            lists = text_search.query_lists(session, engine, description, {})
            fused = text_search.fuse([lists.full_text, lists.dense, lists.predicted, lists.near])
            seconds.append(time.perf_counter() - started)
            rankings = {
                "full_text": ranked_ids(session, description, {}, text_search.DEPTH),
                "dense": [i for i, _, _ in text_search.fuse([lists.full_text, lists.dense])],
                "default": [i for i, _, _ in fused],
            }
            for method, ranking in rankings.items():
                kept = [i for i in ranking if i in bare_ids]
                metrics[method]["hit@1"].append(float(bool(kept) and kept[0] in relevant))
                metrics[method]["ndcg@10"].append(ndcg10(kept, relevant))
                # on every adapter: the ranking as it is, relevant every adapter of the task
                metrics[method]["all_ndcg@10"].append(ndcg10(ranking, {i for i in names if task_of[names[i]] == task}))
            for i, _, why in fused[:10]:
                if i in bare_ids:
                    reasons["text" if why[0] == "text" else "predicted" if why[0].startswith("predicted") else "near"] += 1

    def interval(values: list[float]) -> list[float]:
        iv = clustered_bootstrap(values, [tasks])
        return [round(float(iv.mean), 3), round(float(iv.low), 3), round(float(iv.high), 3)]

    out: dict[str, object] = {
        "zoo": str(args.zoo),
        "adapters": len(task_of),
        "without_text": len(bare),
        "tasks": len(tasks),
        "index_build_s": round(build_s, 1),
        "query_ms_median": round(1000 * float(np.median(seconds)), 1),
        **{f"{m}_{k}": interval(v) for m, per in metrics.items() for k, v in per.items()},
        "gain_ndcg@10_default_vs_full_text": interval(list(np.subtract(metrics["default"]["ndcg@10"], metrics["full_text"]["ndcg@10"]))),
        "gain_ndcg@10_dense_vs_full_text": interval(list(np.subtract(metrics["dense"]["ndcg@10"], metrics["full_text"]["ndcg@10"]))),
        "why_of_bare_in_top10": reasons,
    }
    for method, per in metrics.items():
        bare_part = f"hit@1 {interval(per['hit@1'])} nDCG@10 {interval(per['ndcg@10'])}"
        print(f"{method:10s} without text: {bare_part}; all: nDCG@10 {interval(per['all_ndcg@10'])}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
