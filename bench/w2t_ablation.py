"""W2T alone, part by part: v1, + Gram sketches, + pretraining (distilling an exact score), + its nuisance views, all;
against the exact input Gram and dW cosines, on the splits `zoo eval` uses.

Per split (embed.training.splits.split_of with `--per-task` labelled adapters per task, seeds SEED, SEED+1, ...), each
configuration's W2T is trained with `zoo train`'s options (embed.training.train.train_w2t: `--members` models, the choices out
of fold) on every adapter, the queries without their labels, and scored as `zoo eval` scores a similarity: every query
(an unlabelled adapter with a task) ranks every other adapter, relevant = same task (hit@1, MRR, nDCG@10), and the
10-NN among the labelled adapters, by the similarity, estimates each query's test accuracy (Spearman with the
measured one). `default` rows score the search each trained W2T chose out of fold. Gains are paired by split, 95 %
t interval over the splits.

    python -m bench.w2t_ablation --data-dir DIR [--per-task 8] [--splits 10] [--members 1] [--configs v1,gram,...]
    python -m bench.w2t_ablation --merge OUT1.json OUT2.json ...   # runs of other configurations on the same splits

The exact scores (embed.training.distill.token_kernel on full-width tokens: exact_cosines' values) are computed once and given
to each training, which would otherwise compute them again. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import numpy as np
import torch
from scipy import stats

from embed.data.dataset import ExactScores, base_models, load_adapters
from embed.data.tokens import max_rank, tokenize
from embed.data.types import ZooAdapter, schema_of
from embed.selection.metrics import knn_regress, regression, retrieval
from embed.selection.search_choice import rerank_values
from embed.training.distill import token_kernel
from embed.training.evaluate import PERF_METRIC
from embed.training.pretrain import Pretrained, pretrain
from embed.training.splits import split_of
from embed.training.train import train_w2t, w2t_config
from embed.training.train_options import TrainOptions
from zoo.config import Settings
from zoo.domain.exact_scores import EXACT_SCORES
from zoo.labels import TASK_KEY
from zoo.store.blobs import BlobStore
from zoo.store.session import session_factory

MEASURES = ("hit@1", "mrr", "ndcg@10", "perf_spearman")


def configurations(pretrain_epochs: int) -> dict[str, dict[str, object]]:
    """Each ablated configuration's TrainOptions changes over v1's."""
    pre = {"pretrain_epochs": pretrain_epochs}
    return {
        "v1": {},
        "gram": {"gram_sketches": True},
        "pretrain": {**pre, "pretrain_augment": False},
        "pretrain_views": {**pre, "pretrain_augment": True},
        "all": {"gram_sketches": True, **pre, "pretrain_augment": True},
    }


def score(sim: np.ndarray, adapters: list[ZooAdapter], labelled: list[int], queries: list[int]) -> dict[str, float]:
    """`zoo eval`'s measures of a similarity on one split (embed.training.evaluate: its rows' retrieval and kNN performance)."""
    tasks = [a.labels.get(TASK_KEY, "") for a in adapters]
    q = [p for p in queries if tasks[p]]
    out = {k: v for k, v in retrieval(sim[q], [tasks[p] for p in q], tasks, list(q)).items() if k in MEASURES}
    perf = np.array([a.measurements.get(PERF_METRIC, np.nan) for a in adapters])
    if not np.isnan(perf[labelled + queries]).any():
        out["perf_spearman"] = regression(knn_regress(sim[np.ix_(queries, labelled)], perf[labelled]), perf[queries])["perf_spearman"]
    return out


def interval(diffs: list[float]) -> tuple[float, float, float]:
    d = np.asarray(diffs)
    half = float(stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
    return float(d.mean()), float(d.mean()) - half, float(d.mean()) + half


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir")
    p.add_argument("--merge", nargs="+", help="the JSON last lines of runs to put in one table")
    p.add_argument("--space")
    p.add_argument("--per-task", type=int, default=8)
    p.add_argument("--splits", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--members", type=int, default=TrainOptions().members)
    p.add_argument("--epochs", type=int, default=TrainOptions().epochs)
    p.add_argument("--patience", type=int, default=TrainOptions().patience)
    p.add_argument("--pretrain-epochs", type=int, default=30)
    p.add_argument("--pretrain-score", default="auto", help="the exact score pretraining distils (auto: the first split's labels pick)")
    p.add_argument("--configs", default="v1,gram,pretrain,pretrain_views,all")
    args = p.parse_args()
    rows = merged(args.merge) if args.merge else measured(args)
    report(rows, vars(args))


def merged(paths: list[str]) -> dict[str, list[dict[str, float]]]:
    """The per-split rows of several runs on the same zoo (their per-split lines; a run cut short gives the splits it
    finished), each with its split."""
    rows: dict[str, dict[int, dict[str, float]]] = {}
    for path in paths:
        with open(path) as f:
            for line in (json.loads(x) for x in f if x.startswith('{"split"')):
                for name, row in line.items():
                    if isinstance(row, dict):
                        rows.setdefault(name, {})[line["split"]] = {**row, "split": line["split"]}
    return {name: [per[s] for s in sorted(per)] for name, per in rows.items()}


def measured(args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    if not args.data_dir:
        raise SystemExit("give --data-dir (or --merge)")
    settings = Settings.load(data_dir=args.data_dir)
    with session_factory(settings.database_url)() as session:
        space = args.space or base_models(session)[0]
        adapters = load_adapters(session, BlobStore(settings.blob_dir), space)
    schema = schema_of(space, adapters)
    tokens = tokenize(adapters, schema, max_rank(adapters))
    exact = {s: token_kernel(tokens, s).numpy() for s in EXACT_SCORES}
    given = ExactScores(np.array([a.id for a in adapters], dtype=np.int64), exact)
    chosen = configurations(args.pretrain_epochs)

    def options_of(name: str, seed: int) -> TrainOptions:
        base = TrainOptions(seed=seed, members=args.members, epochs=args.epochs, patience=args.patience, pretrain_score=args.pretrain_score)
        return replace(base, **chosen[name])  # type: ignore[arg-type]

    # pretraining reads every adapter's weights and no label (but where its score is "auto", which the first split's
    # labels pick): done once per configuration, as a zoo is pretrained once, and shared by the splits
    pretrained: dict[str, Pretrained] = {}
    fit0 = split_of(adapters, 0.2, args.seed, args.per_task, None)[2]
    for name in args.configs.split(","):
        options = options_of(name, args.seed)
        if options.pretrain_epochs:
            config = w2t_config(fit0, schema, options, max_rank(adapters))
            tasks = [a.labels.get(TASK_KEY, "") for a in fit0]
            t0 = time.perf_counter()
            # the model reads tokens as its config makes them (projected where a side is wider than its token width)
            own = tokenize(adapters, schema, max_rank(adapters), config.tokens)
            pretrained[name] = pretrain(config, own, tasks, options, torch.device("cpu"))
            print(f"pretrained {name} in {time.perf_counter() - t0:.0f} s: {pretrained[name][1]}", flush=True)
    rows: dict[str, list[dict[str, float]]] = {"dw cosine": [], "input Gram cosine": []}
    for s in range(args.seed, args.seed + args.splits):
        labelled, queries, fit = split_of(adapters, 0.2, s, args.per_task, None)
        rows["dw cosine"].append({**score(exact["dw"], adapters, labelled, queries), "split": s})
        rows["input Gram cosine"].append({**score(exact["input_gram"], adapters, labelled, queries), "split": s})
        for name in args.configs.split(","):
            t0 = time.perf_counter()
            emb = train_w2t(fit, schema, options_of(name, s), progress=False, exact=given, pretrained=pretrained.get(name))
            took = time.perf_counter() - t0
            z = emb.embed(adapters)
            w2t = z @ z.T
            rows.setdefault(name, []).append({**score(w2t, adapters, labelled, queries), "seconds": took, "split": s})
            served = emb.search.ranking(exact[emb.search.exact], w2t, np.eye(len(w2t), dtype=bool), rerank_values(emb.search, exact))
            rows.setdefault(f"default ({name})", []).append({**score(served, adapters, labelled, queries), "split": s})
            line = {"split": s, "config": name, name: rows[name][-1], f"default ({name})": rows[f"default ({name})"][-1]}
            line.update({"dw cosine": rows["dw cosine"][-1], "input Gram cosine": rows["input Gram cosine"][-1], "search": emb.search.name})
            print(json.dumps(line), flush=True)
    return rows


def report(rows: dict[str, list[dict[str, float]]], args: dict[str, object]) -> None:
    """Each row's means over its splits, and its gains over v1 and the input Gram paired on the splits both have."""
    summary: dict[str, dict[str, float]] = {}
    for name, per in rows.items():
        summary[name] = {k: float(np.mean([r[k] for r in per])) for k in (*MEASURES, "seconds") if k in per[0]}
        summary[name]["splits"] = len(per)
    gains: dict[str, dict[str, tuple[float, float, float]]] = {}
    for name in rows:
        for base in ("v1", "input Gram cosine"):
            if name in (base, "dw cosine") or base not in rows:
                continue
            at = {r["split"]: r for r in rows[base]}
            pairs = [(r, at[r["split"]]) for r in rows[name] if r["split"] in at]
            # a zoo without measured test accuracy has no performance Spearman
            measures = [k for k in MEASURES if pairs and all(k in a and k in b for a, b in pairs)]
            gains[f"{name} - {base}"] = {k: interval([a[k] - b[k] for a, b in pairs]) for k in measures}
            gains[f"{name} - {base}"]["splits"] = (len(pairs), len(pairs), len(pairs))
    for name, m in summary.items():
        print(f"{name:28s} " + "  ".join(f"{k} {v:.3f}" for k, v in m.items()))
    for name, g in gains.items():
        print(f"{name:40s} " + "  ".join(f"{k} {v[0]:+.3f} [{v[1]:+.3f}, {v[2]:+.3f}]" for k, v in g.items()))
    print(json.dumps({"args": args, "summary": summary, "gains": gains, "per_split": rows}))


if __name__ == "__main__":
    main()
