"""Search by meaning on reference zoos whose half lost its text: does a task's one-sentence description reach the
adapters without labels? Over several splits and recipes, with intervals.

Per recipe (digits-vit, shapes-cnn, docs-minilm, and their -seeded variants, which share their tasks; each zoo made by
`zoo make-zoo --seed 0` when --zoos has none, or a zoo already built given by --zoo) the zoo is ingested with its
labels and embedded once; each split copies it, removes every given label and measurement of a half of its adapters
drawn with the split's seed (they keep just their name, `digits-vit-00012`), and trains W2T on the labelled half.
Each task's description (written from the recipe's task definitions, zoo/reference/) queries the zoo; these rankings
are scored on the adapters without text (the ranking kept to them, relevant those of the task):

- full text alone;
- dense text: full text and the sentence index fused;
- dense + expansion: and the predicted attributes and the weight-space neighbours of the text hits;
- zero-shot: the base model's response score alone (embed/serving/zero_shot.py), where the base can be run (docs-minilm's
  MiniLM; an image base reads no text: not applicable);
- default: everything search by meaning fuses (dense + expansion, and zero-shot where it runs);
- chance: what a uniformly random ordering of the adapters without text scores, in expectation (the bar a ranking
  must clear: on a small zoo, a half of a few dozen adapters, any order of them all scores nDCG@10 near 0.5).

hit@1 and nDCG@10 per query; means with 95 % intervals from a bootstrap over splits and tasks crossed
(embed/training/intervals.py), per recipe and pooled, and the paired gains over full text. Results per split are appended to
WORK/results.jsonl, so a run that stops can go on (`--splits` more, or another recipe) without redoing them; processes
started with the same WORK share the splits (each claims the next one: WORK/RECIPE/split-NN.claim; remove the claims of
a run that was killed).

    python -m bench.text_search --zoos /tmp/t59/zoos --work /tmp/t59/bench --recipes digits-vit,shapes-cnn --splits 10
    python -m bench.text_search --zoo /tmp/t59/zoos/dms --recipes docs-minilm-seeded --work /tmp/t59/dms --splits 10
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import sqlite3
import time
from contextlib import closing
from pathlib import Path

import numpy as np

#: a sentence per task, as a user would ask for it
DESCRIPTIONS: dict[str, dict[str, str]] = {
    "digits-vit": {
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
    },
    "shapes-cnn": {
        "pair-disk-ring": "tell a filled disk from a ring",
        "pair-square-frame": "distinguish solid squares from square frames",
        "pair-plus-cross": "separate plus signs from diagonal crosses",
        "pair-stripes": "classify horizontal versus vertical stripes",
        "pair-triangle-square": "tell triangles apart from squares",
        "subset-filled": "recognise filled shapes: disks, squares and triangles",
        "subset-outline": "recognise outlined shapes such as rings, frames, plus signs and crosses",
        "subset-texture": "classify textures: stripes and checkerboards",
        "rot90": "classify shapes rotated by ninety degrees",
        "flipud": "classify shapes flipped upside down",
        "invert": "classify shapes drawn with inverted colours",
        "blur": "recognise blurred shapes",
        "noise": "classify shapes in noisy images",
        "pixelate": "classify pixelated low resolution shapes",
        "shift-labels": "predict the next shape class after the one shown",
        "label-noise": "learn shapes from training labels that are partly wrong",
        "size": "tell large shapes from small ones",
    },
    "docs-minilm": {
        "networking-vs-files": "tell documentation about networking apart from documentation about files",
        "concurrency-vs-numbers": "classify docstrings as about concurrency or about numbers and math",
        "text-vs-testing": "separate text processing documentation from testing documentation",
        "files-vs-text": "distinguish file handling docs from text processing docs",
        "networking-vs-concurrency": "decide whether a docstring is about networking or about threads and concurrency",
        "numbers-vs-testing": "classify documentation about numbers versus unit testing",
        "triad-io": "sort input and output documentation into networking, files and concurrency",
        "triad-logic": "sort documentation into text processing, numbers and testing",
        "all-topics": "classify Python standard library documentation into its six topics",
    },
}
#: the rankings scored, in the order printed
METHODS = ("chance", "full_text", "dense", "expansion", "zero_shot", "default")
#: a recipe's variant whose adapters draw their own seeds has the recipe's tasks (zoo/reference/recipes.py)
SEEDED = "-seeded"


def descriptions(recipe: str) -> dict[str, str]:
    """A sentence per task of the recipe: a -seeded variant's are its pinned recipe's (the same tasks and plan)."""
    tasks = DESCRIPTIONS.get(recipe.removesuffix(SEEDED))
    if tasks is None:
        raise SystemExit(
            f"no task descriptions for recipe {recipe!r}: one of {', '.join(sorted(DESCRIPTIONS))}, or their {SEEDED} variants"
        )
    return tasks


def zoo_dir(recipe: str, zoos: Path, built: Path | None) -> Path:
    """Where the recipe's zoo is: `built` (--zoo, a zoo `zoo make-zoo` finished, its labels.csv written) or ZOOS/RECIPE."""
    if built is None:
        return zoos / recipe
    if not (built / "labels.csv").exists():
        raise SystemExit(f"--zoo {built}: no labels.csv there (a zoo still being built, or not one `zoo make-zoo` made)")
    return built


def ndcg10(ranking: list[int], relevant: set[int]) -> float:
    gains = [1.0 / np.log2(r + 2) for r, i in enumerate(ranking[:10]) if i in relevant]
    ideal = sum(1.0 / np.log2(r + 2) for r in range(min(10, len(relevant))))
    return float(sum(gains) / ideal) if ideal else 0.0


def chance(ranked: int, relevant: int) -> tuple[float, float]:
    """(hit@1, nDCG@10) that a uniformly random ordering of `ranked` items, `relevant` of them relevant, scores in
    expectation: each place holds a relevant item with probability relevant / ranked."""
    if not ranked or not relevant:
        return 0.0, 0.0
    p = relevant / ranked
    ideal = sum(1.0 / np.log2(r + 2) for r in range(min(10, relevant)))
    return p, p * sum(1.0 / np.log2(r + 2) for r in range(min(10, ranked))) / ideal


def reason(why: str) -> str:
    """The kind of a result's first reason: text, predicted, zero-shot or near."""
    return next((k for k in ("text", "predicted", "zero-shot") if why.startswith(k)), "near")


def base_zoo(recipe: str, zoo: Path, work: Path, count: int) -> tuple[Path, dict[str, str]]:
    """The recipe's zoo (made at `zoo` if it is not there) ingested with every label and embedded, once
    (WORK/RECIPE/base); its task by adapter name."""
    from zoo.cli import main
    from zoo.store.session import make_engine, upgrade

    if not (zoo / "labels.csv").exists():
        assert main(["make-zoo", str(zoo), "--recipe", recipe, "--count", str(count), "--seed", "0", "--json"]) == 0
    with (zoo / "labels.csv").open() as fh:
        task_of = {r["name"]: r["task"] for r in csv.DictReader(fh)}
    base = work / recipe / "base"
    if not (base / "done").exists():
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir(parents=True)
        url = f"sqlite:///{base / 'zoo.db'}"
        upgrade(url)
        args = ["--db", url, "--data-dir", str(base / "data")]
        assert main([*args, "ingest", str(zoo), "--labels", str(zoo / "labels.csv"), "--json"]) == 0
        assert main([*args, "embed", "--json"]) == 0
        make_engine(url).dispose()
        (base / "done").touch()
    return base, task_of


def split_zoo(base: Path, work: Path, split: int, epochs: int, members: int) -> tuple[str, Path, set[str]]:
    """(database URL, data dir, names without text) of a split: the base copied, a seeded half's labels removed, W2T
    trained on the rest."""
    from zoo.cli import main
    from zoo.store.labels import given_labels, remove_label
    from zoo.store.models import Adapter
    from zoo.store.session import make_engine, session_factory, write_transaction

    here = work / f"split-{split:02d}"
    url = f"sqlite:///{here / 'zoo.db'}"
    if (here / "trained").exists():  # a run stopped after training it: the same half again, from the same seed
        with session_factory(url)() as session:
            names = sorted(n for (n,) in session.query(Adapter.name))
        return url, here / "data", set(np.random.default_rng(split).choice(names, size=len(names) // 2, replace=False).tolist())
    shutil.rmtree(here, ignore_errors=True)
    here.mkdir(parents=True)
    with closing(sqlite3.connect(base / "zoo.db")) as have, closing(sqlite3.connect(here / "zoo.db")) as copy:
        have.backup(copy)
    shutil.copytree(base / "data", here / "data")
    sessions = session_factory(url)
    with sessions() as session:
        ids = dict(session.query(Adapter.name, Adapter.id).all())
    names = sorted(ids)
    bare = set(np.random.default_rng(split).choice(names, size=len(names) // 2, replace=False).tolist())
    with write_transaction(sessions) as session:
        for name in sorted(bare):
            labels, measured = given_labels(session, ids[name])
            for key in sorted({*labels, *measured}):
                remove_label(session, ids[name], key)
    make_engine(url).dispose()
    args = ["--db", url, "--data-dir", str(here / "data")]
    assert main([*args, "train", "--epochs", str(epochs), "--members", str(members), "--seed", str(split), "--json"]) == 0
    (here / "trained").touch()
    return url, here / "data", bare


def evaluate(recipe: str, url: str, data: Path, task_of: dict[str, str], bare: set[str]) -> list[dict[str, object]]:
    """A record per task: each ranking's hit@1 and nDCG@10 without text, and nDCG@10 over every adapter."""
    from embed.serving import text_index, text_search, zero_shot
    from embed.serving.engine import QueryEngine
    from zoo.store.blobs import BlobStore
    from zoo.store.catalog import ranked_ids
    from zoo.store.models import Adapter
    from zoo.store.session import session_factory

    sessions = session_factory(url)
    engine = QueryEngine(sessions, BlobStore(data / "blobs"), data)
    records: list[dict[str, object]] = []
    with sessions() as session:
        names = {i: n for i, n in session.query(Adapter.id, Adapter.name)}
        base_model = session.query(Adapter.base_model).first()[0]
        runs = zero_shot.not_runnable(base_model) is None
        bare_ids = {i for i, n in names.items() if n in bare}
        started = time.perf_counter()
        text_index.current_index(session, engine)
        build_s = time.perf_counter() - started
        for task, description in descriptions(recipe).items():
            relevant = {i for i in bare_ids if task_of.get(names[i]) == task}  # an adapter labels.csv lacks: no task
            if not relevant:
                continue
            started = time.perf_counter()
            lists = text_search.query_lists(session, engine, description, {})
            fused = text_search.fuse(lists.all())
            seconds = time.perf_counter() - started
            rankings: dict[str, list[int] | None] = {
                "full_text": ranked_ids(session, description, {}, text_search.DEPTH),
                "dense": [i for i, _, _ in text_search.fuse([lists.full_text, lists.dense])],
                "expansion": [i for i, _, _ in text_search.fuse([lists.full_text, lists.dense, lists.predicted, lists.near])],
                "zero_shot": [i for i, _ in lists.zero_shot] if runs else None,
                "default": [i for i, _, _ in fused],
            }
            record: dict[str, object] = {"task": task, "seconds": seconds, "index_build_s": build_s}
            everyone = {i for i in names if task_of.get(names[i]) == task}
            record["chance.hit@1"], record["chance.ndcg@10"] = chance(len(bare_ids), len(relevant))
            record["chance.all_ndcg@10"] = chance(len(names), len(everyone))[1]
            for method, ranking in rankings.items():
                if ranking is None:
                    continue
                kept = [i for i in ranking if i in bare_ids]
                record[f"{method}.hit@1"] = float(bool(kept) and kept[0] in relevant)
                record[f"{method}.ndcg@10"] = ndcg10(kept, relevant)
                record[f"{method}.all_ndcg@10"] = ndcg10(ranking, everyone)
            record["why_bare_top10"] = [reason(w[0]) for i, _, w in fused[:10] if i in bare_ids]
            records.append(record)
    return records


def summary(records: list[dict[str, object]]) -> dict[str, object]:
    """Each method's means with intervals (bootstrap over splits and tasks crossed), and the gains over full text."""
    from embed.training.intervals import clustered_bootstrap

    def interval(values: list[float], rows: list[dict[str, object]]) -> list[float]:
        iv = clustered_bootstrap(values, [[r["split"] for r in rows], [f"{r['recipe']}/{r['task']}" for r in rows]])
        return [round(iv.mean, 3), round(iv.low, 3), round(iv.high, 3)]

    out: dict[str, object] = {
        "queries": len(records),
        "splits": len({r["split"] for r in records}),
        "tasks": len({(r["recipe"], r["task"]) for r in records}),
    }
    for method in METHODS:
        rows = [r for r in records if f"{method}.ndcg@10" in r]
        if not rows:
            out[method] = "not applicable"
            continue
        out[method] = {m: interval([float(r[f"{method}.{m}"]) for r in rows], rows) for m in ("hit@1", "ndcg@10", "all_ndcg@10")}
        if method not in ("chance", "full_text"):
            for bar in ("full_text", "chance"):
                paired = [r for r in rows if f"{bar}.ndcg@10" in r]  # results of a run from before the chance row have none
                if paired:
                    gain = [float(r[f"{method}.ndcg@10"]) - float(r[f"{bar}.ndcg@10"]) for r in paired]
                    out[f"gain_ndcg@10_{method}_vs_{bar}"] = interval(gain, paired)
    both = [r for r in records if "zero_shot.ndcg@10" in r]
    if both:  # what zero-shot adds to the rest
        gain = [float(r["default.ndcg@10"]) - float(r["expansion.ndcg@10"]) for r in both]
        out["gain_ndcg@10_default_vs_expansion"] = interval(gain, both)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoos", type=Path, default=Path("/tmp/textsearch/zoos"), help="a zoo per recipe, DIR/RECIPE")
    parser.add_argument("--work", type=Path, default=Path("/tmp/textsearch/bench"))
    parser.add_argument("--recipes", default="digits-vit,shapes-cnn")
    parser.add_argument(
        "--zoo", type=Path, help="a zoo already built (zoo make-zoo) for the one recipe of --recipes, in place of ZOOS/RECIPE"
    )
    parser.add_argument("--splits", type=int, default=10)
    parser.add_argument("--count", type=int, default=120, help="adapters of a zoo made here")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--reverse", action="store_true", help="take the splits last first (beside a process taking them in order)")
    args = parser.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    results = args.work / "results.jsonl"
    records = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    recipes = args.recipes.split(",")
    if args.zoo is not None and len(recipes) != 1:
        parser.error("--zoo is the zoo of one recipe: give --recipes one")
    for recipe in recipes:
        descriptions(recipe)  # a recipe without descriptions stops before its zoo is made or ingested
        base, task_of = base_zoo(recipe, zoo_dir(recipe, args.zoos, args.zoo), args.work, args.count)
        for split in reversed(range(args.splits)) if args.reverse else range(args.splits):
            claim = args.work / recipe / f"split-{split:02d}.claim"
            if any(r["recipe"] == recipe and r["split"] == split for r in records) or claim.exists():
                continue
            claim.touch()  # another process started with the same --work takes the next split instead
            started = time.perf_counter()
            url, data, bare = split_zoo(base, args.work / recipe, split, args.epochs, args.members)
            mine = [{"recipe": recipe, "split": split, **r} for r in evaluate(recipe, url, data, task_of, bare)]
            with results.open("a") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in mine)
            records += mine
            shutil.rmtree(args.work / recipe / f"split-{split:02d}", ignore_errors=True)
            print(f"{recipe} split {split}: {len(mine)} queries, {time.perf_counter() - started:.0f} s", flush=True)
    records = [json.loads(line) for line in results.read_text().splitlines()]  # those other processes wrote too
    mine = [r for r in records if r["recipe"] in recipes and r["split"] < args.splits]
    out: dict[str, object] = {"pooled": summary(mine)} if len(recipes) > 1 else {}
    out.update({recipe: summary([r for r in mine if r["recipe"] == recipe]) for recipe in recipes})
    out["why_bare_top10"] = {k: sum(r["why_bare_top10"].count(k) for r in mine) for k in ("text", "predicted", "near", "zero-shot")}
    out["query_ms_median"] = round(1000 * float(np.median([float(r["seconds"]) for r in mine])), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
