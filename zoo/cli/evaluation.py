"""`zoo eval`: every method on held-out splits of a space, compared paired; `--save` keeps each split's result in a file
and `--pool` summarizes saved splits, one run or several (embed/training/saved_splits.py)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from tqdm import tqdm

from zoo.cli.render import duration, eval_lines, interval_text, plural, print_json, table
from zoo.cli.spaces import MEMBERS_HELP, UNLABELLED_HELP, VAL_FRACTION_HELP, blob_store, space_of
from zoo.config import Settings
from zoo.errors import UsageError
from zoo.store.session import require_schema, session_factory

if TYPE_CHECKING:
    from embed.data.types import SpaceSchema, ZooAdapter
    from embed.training.evaluate import Similarities
    from embed.training.train_options import TrainOptions

#: the options that decide a split's result besides its seed: a split saved with others is not read back as this run's
SPLIT_OPTIONS = (
    "epochs",
    "members",
    "val_fraction",
    "test_fraction",
    "labelled_per_task",
    "label_fraction",
    "objective",
    "unlabelled_per_labelled",
    "no_contrastive",
)


def cmd_eval(settings: Settings, args: argparse.Namespace) -> int:
    from embed.data.dataset import load_adapters
    from embed.data.types import schema_of
    from embed.training.eval_summary import summarize
    from embed.training.evaluate import similarities
    from embed.training.saved_splits import save_split, saved_split

    if args.pool:
        if args.save:
            raise UsageError("--pool reads saved splits and runs none: it takes no --save")
        return _pool(args)
    if args.splits < 1:
        raise UsageError(f"--splits must be at least 1, got {args.splits}")
    per_task, fraction = args.labelled_per_task, args.label_fraction
    if per_task is not None and per_task < 1 or fraction is not None and not 0 < fraction < 1:
        raise UsageError("--labelled-per-task must be at least 1 and --label-fraction between 0 and 1")
    require_schema(settings.database_url)
    space = space_of(settings, args.space)
    with session_factory(settings.database_url)() as session:
        adapters = load_adapters(session, blob_store(settings), space)
    if len(adapters) < 10:
        raise UsageError(f"space {space} has {plural(len(adapters), 'adapter')}: evaluation needs at least 10")
    started = time.perf_counter()
    save = Path(args.save) if args.save else None
    options = {"space": space, **{k: getattr(args, k) for k in SPLIT_OPTIONS}}
    seeds = range(args.seed, args.seed + args.splits)
    saved = {seed: saved_split(save, seed, options) for seed in seeds} if save else {}  # read back, not run again
    todo = [seed for seed in seeds if saved.get(seed) is None]
    schema = schema_of(space, adapters)
    sims = similarities(adapters, schema) if todo else None  # the same for every split
    estimate = None if args.json or sims is None else _eval_estimate(args, adapters, schema, sims.seconds, len(todo))
    results = []
    for i, seed in enumerate(seeds):
        result = saved.get(seed)
        if result is None:
            result = _eval_split(args, adapters, schema, cast("Similarities", sims), seed, i)
            if save:
                save_split(result, save, options)
        results.append(result)
    result = summarize(results)
    if args.json:
        print_json(result)
        return 0
    print("\n".join(eval_lines(result)))
    took = time.perf_counter() - started
    print(f"took {duration(took)}" + (f" (estimated: about {duration(estimate)})" if estimate is not None else ""), file=sys.stderr)
    return 0


def _pool(args: argparse.Namespace) -> int:
    """`zoo eval --pool DIR...`: one DIR summarized as its run (embed.training.eval_summary.summarize); several, each one's search
    regret and the regret pooled over them (embed.training.saved_splits.pooled_regret)."""
    from embed.training.eval_summary import cross_fitted_regret, summarize
    from embed.training.evaluate import REGRET_KEYS
    from embed.training.saved_splits import load_run, pooled_regret

    runs = [load_run(Path(d)) for d in args.pool]
    if len(runs) == 1:
        result = summarize(runs[0])
        if args.json:
            print_json(result)
        else:
            print("\n".join(eval_lines(result)))
        return 0
    each = [
        {
            "dir": d,
            "space": run[0]["space"],
            "protocol": run[0]["protocol"],
            "seeds": [r["seed"] for r in run],
            "search_regret": {k: {n: v for n, v in c.items() if n != "splits"} for k, c in cross_fitted_regret(run).items()},
        }
        for d, run in zip(args.pool, runs, strict=True)
    ]
    pooled = pooled_regret(runs)
    if args.json:
        print_json({"runs": each, "pooled_regret": pooled})
        return 0
    rows = [
        [r["dir"], r["space"], r["protocol"], len(r["seeds"]), *(interval_text(r["search_regret"].get(k)) for k in REGRET_KEYS)]
        for r in each
    ]
    rows.append(["pooled", "", "", sum(len(r["seeds"]) for r in each), *(interval_text(pooled.get(k)) for k in REGRET_KEYS)])
    print("search regret (the search chosen on a run's other splits, fixed, minus the one served), with 95 % intervals:")
    print("\n".join(table(["run", "space", "protocol", "splits", *REGRET_KEYS], rows, right=[False, False, False, True, True, True, True])))
    return 0


def train_options_of(args: argparse.Namespace, seed: int) -> TrainOptions:
    from embed.training.train_options import TrainOptions

    return TrainOptions(
        epochs=args.epochs,
        seed=seed,
        device=args.device,
        members=args.members,
        val_fraction=args.val_fraction,
        unlabelled_per_labelled=args.unlabelled_per_labelled,
    )


def _eval_estimate(args: argparse.Namespace, adapters: list[ZooAdapter], schema: SpaceSchema, done: dict[str, float], splits: int) -> float:
    """Print, before `splits` splits run, how long they should take (embed.training.evaluate.estimate_seconds, from two short
    timed trainings, plus the similarities already computed); return the whole estimate in seconds."""
    from embed.training.evaluate import estimate_seconds
    from embed.training.splits import split_of

    t0 = time.perf_counter()
    fit = split_of(adapters, args.test_fraction, args.seed, args.labelled_per_task, args.label_fraction)[2]
    training = estimate_seconds(fit, schema, train_options_of(args, args.seed), splits, not args.no_contrastive)
    spent = sum(done.values()) + time.perf_counter() - t0
    w2t = f"{plural(args.members, 'W2T model')} × up to {args.epochs} epochs, {'twice' if not args.no_contrastive else 'once'} a split"
    print(
        f"zoo eval: {plural(splits, 'split')} of {plural(len(adapters), 'adapter')} in {schema.base_model} ({w2t}): "
        f"about {duration(training)} at most (models that stop improving stop early)",
        file=sys.stderr,
    )
    return spent + training


def _eval_split(
    args: argparse.Namespace, adapters: list[ZooAdapter], schema: SpaceSchema, sims: Similarities, seed: int, index: int
) -> dict[str, Any]:
    """One split, with its progress bar (`split 2/5`, a step per stage; on a terminal only, as the other bars)."""
    from embed.training.evaluate import evaluate, stages

    contrastive = not args.no_contrastive
    steps = stages(contrastive)
    desc = f"split {index + 1}/{args.splits}"
    with tqdm(total=len(steps), desc=desc, unit="stage", disable=True if args.json else None, file=sys.stderr) as bar:

        def on_stage(name: str) -> None:
            bar.update(steps.index(name) - bar.n)
            bar.set_postfix_str(name)

        result = evaluate(
            adapters,
            schema,
            train_options_of(args, seed),
            args.test_fraction,
            seed,
            progress=False,
            contrastive=contrastive,
            labelled_per_task=args.labelled_per_task,
            label_fraction=args.label_fraction,
            objective=args.objective,
            sims=sims,
            on_stage=on_stage,
        )
        bar.update(len(steps) - bar.n)
    return result


def add_commands(sub: argparse._SubParsersAction) -> None:
    """This module's command on the `zoo` parser."""
    s = sub.add_parser(
        "eval",
        help="compare W2T embeddings with training-free baselines on a held-out split",
        description="Splits the space's adapters (seeded, by adapter), trains W2T (supervised and "
        "contrastive) on the training part and scores every method on the held-out part: "
        "task accuracy and macro-F1, test-accuracy MAE/Spearman/Kendall, retrieval "
        "Hit@1/Hit@10/MRR/nDCG@10 (relevance = same task).",
    )
    s.add_argument("--space", help="base model (default: the only one)")
    s.add_argument("--epochs", type=int, default=80)
    s.add_argument("--members", type=int, default=5, help=MEMBERS_HELP)
    s.add_argument("--val-fraction", type=float, default=0.15, help=VAL_FRACTION_HELP)
    s.add_argument("--test-fraction", type=float, default=0.2, help="full labels: the adapters held out (default: %(default)s)")
    scarce = s.add_mutually_exclusive_group()
    scarce.add_argument(
        "--labelled-per-task",
        type=int,
        metavar="N",
        help="label-scarce protocol: per task, N adapters keep their labels; the others are ingested unlabelled and are the queries",
    )
    scarce.add_argument("--label-fraction", type=float, metavar="F", help="label-scarce protocol: a fraction F of each task is labelled")
    s.add_argument(
        "--objective",
        choices=["supervised", "both"],
        default="supervised",
        help="of the W2T that `zoo train` makes and the default row uses: supervised, or both (also contrastive on every "
        "adapter, the unlabelled included) (default: %(default)s)",
    )
    s.add_argument("--unlabelled-per-labelled", type=float, metavar="R", help=UNLABELLED_HELP)
    s.add_argument("--seed", type=int, default=0, help="seed of the split and of the W2T members (default: 0)")
    s.add_argument(
        "--splits",
        type=int,
        default=1,
        help="evaluate on this many splits (seeds SEED, SEED+1, ...): mean ± std over them, paired differences with 95 %% "
        "intervals and the search choice's regret (10 or more for intervals worth reading; default: 1)",
    )
    s.add_argument(
        "--no-contrastive",
        action="store_true",
        help="leave W2T (contrastive) out (its row is null): about half the training time",
    )
    s.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    s.add_argument(
        "--save",
        metavar="DIR",
        help="write each split's result, its per-query scores included, to DIR/split-SEED.json as it finishes; a split "
        "already saved there is read, not run again (an error if it ran with other options): splits run in several "
        "processes into one DIR (--seed 0 --splits 5, --seed 5 --splits 5) summarize together with --pool DIR",
    )
    s.add_argument(
        "--pool",
        nargs="+",
        metavar="DIR",
        help="run nothing: summarize the splits saved in DIR by --save as one run does; with several DIRs (recipes, label "
        "budgets), each one's search regret and the regret pooled over all of them, with its 95 %% interval",
    )
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_eval)
