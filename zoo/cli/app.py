"""`zoo init`, `zoo quickstart`, `zoo make-zoo`, `zoo serve`, `zoo token`: setting a zoo up and serving it."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from zoo.cli.adapters import run_ingest
from zoo.cli.render import plural, print_json, print_zoo_report, relations_line
from zoo.config import Settings
from zoo.labels import read_labels_csv
from zoo.reference.recipes import RECIPES
from zoo.store import tokens
from zoo.store.session import make_engine, require_schema, session_factory, upgrade

if TYPE_CHECKING:
    pass


def cmd_init(settings: Settings, args: argparse.Namespace) -> int:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    info = {
        "database": make_engine(settings.database_url).url.render_as_string(hide_password=True),
        "data_dir": str(settings.data_dir),
        "status": "ok",
    }
    if args.json:
        print_json(info)
    else:
        print(f"schema is current in {info['database']} (data in {info['data_dir']})")
    return 0


#: the demo's W2T stops a model once its validation loss has not improved for this many epochs (zoo train: 15)
QUICKSTART_PATIENCE = 5


def cmd_quickstart(settings: Settings, args: argparse.Namespace) -> int:
    """The main job on embedded defaults: build a demo zoo, store it, embed it, train W2T, say what to run next."""
    from embed.training import training_resource
    from embed.training.train_options import TrainOptions
    from zoo.reference.build import make_zoo
    from zoo.services.ingest import IngestOptions
    from zoo.services.relations import relation_engine, scan_space
    from zoo.store.blob_backends import open_blob_store

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    zoo_dir = settings.data_dir / "demo-zoo"
    progress = not args.json
    cache = settings.data_dir / "cache"
    report = make_zoo(zoo_dir, "digits-vit", args.count, seed=0, workers=args.workers, cache_dir=cache, progress=progress)
    counts, failures = run_ingest(settings, [str(zoo_dir)], IngestOptions(), read_labels_csv(Path(str(report["labels"]))), False, progress)
    options = TrainOptions(epochs=args.epochs, members=args.members, patience=QUICKSTART_PATIENCE)
    base_model = str(report["base_model"])
    ready = training_resource.prepare_space(settings, base_model, options, args.retrain, progress)
    sessions, blobs = session_factory(settings.database_url), open_blob_store(settings)
    relations = scan_space(relation_engine(sessions, blobs, settings.data_dir), sessions, blobs, base_model)  # as `zoo embed` ends
    if args.json:
        print_json({"zoo": report, "ingest": counts, "database": settings.database_url, **ready, "relations": relations})
        return serve_after(settings, args, failures)
    print_zoo_report(report)
    print(
        f"stored in {make_engine(settings.database_url).url.render_as_string(hide_password=True)}: "
        f"{counts['ingested']} ingested, {counts['duplicate']} already there, {counts['failed']} failed"
    )
    for f in failures:
        print(f"  failed: {f}")
    if ready["embedded_new"]:
        print(f"embedded {plural(ready['embedded_new'], 'new adapter')}: {ready['embedded']} in the module sketch index")
    else:
        print(f"embedded nothing new: all {ready['embedded']} adapters were embedded already")
    print(relations_line(relations))
    trained = ready["w2t"]
    if trained and trained.get("reused"):
        print(
            f"W2T: kept embedder {trained['embedder_id']}, already trained on these {trained['n_adapters']} adapters "
            "(`zoo quickstart --retrain` trains it again)"
        )
    elif trained:
        epochs = "+".join(map(str, trained["epochs"]))
        print(
            f"trained W2T on them: embedder {trained['embedder_id']}, {len(trained['epochs'])} models ({epochs} epochs) "
            f"in {trained['train_seconds']:.0f} s"
        )
    else:
        print("W2T not trained: it needs at least 10 adapters (use a larger --count)")
    print("next:\n" + "\n".join(f"  {line}" for line in next_steps(settings)))
    return serve_after(settings, args, failures)


def next_steps(settings: Settings) -> list[str]:
    """The commands quickstart suggests next, in the order README's "What to run next" gives them."""
    return [
        "zoo list",
        "zoo show 1 --plot spectra.png",
        "zoo search 1 -k 5",
        "zoo predict 1",
        "zoo lineage 1",
        "zoo eval   # W2T against the training-free searches, with 95 % intervals (about 20 min)",
        "zoo ingest PATH_TO_YOUR_ADAPTERS --base-model NAME",
        f"zoo --data-dir {settings.data_dir} serve   # then open http://127.0.0.1:5000/",
    ]


def serve_after(settings: Settings, args: argparse.Namespace, failures: list[str]) -> int:
    if failures or not args.serve:
        return 1 if failures else 0
    from webapp.serve import serve

    print("open http://127.0.0.1:5000/ (Ctrl-C stops the server)", file=sys.stderr)
    serve(settings, "127.0.0.1", 5000, workers=1)
    return 0


def cmd_make_zoo(settings: Settings, args: argparse.Namespace) -> int:
    from zoo.reference.build import make_zoo
    from zoo.reference.lineage import Mix

    report = make_zoo(
        Path(args.out_dir),
        args.recipe,
        args.count,
        seed=args.seed,
        workers=args.workers,
        cache_dir=settings.data_dir / "cache",
        progress=not args.json,
        mix=Mix.parse(args.mix) if args.mix is not None else None,
    )
    if args.json:
        print_json(report)
    else:
        print_zoo_report(report)
        print(f"next: zoo ingest {args.out_dir} --labels {report['labels']}")
    return 0


def cmd_serve(settings: Settings, args: argparse.Namespace) -> int:
    from webapp.serve import serve

    require_schema(settings.database_url)
    print(
        f"zoo: serving {settings.data_dir} on http://{args.host}:{args.port}/ ({args.workers} workers × {args.threads} threads)",
        file=sys.stderr,
    )
    serve(settings, args.host, args.port, args.workers, args.threads)
    return 0


def cmd_token(settings: Settings, args: argparse.Namespace) -> int:
    require_schema(settings.database_url)
    with session_factory(settings.database_url).begin() as session:
        if args.action == "create":
            row, token = tokens.create_token(session, args.name, args.scope)
            created: tokens.NewToken = {**tokens.token_summary(row), "token": token}
            out: object = created
            lines = [
                f"token {created['id']} ({created['name']}, scope {created['scope']}): {token}\n"
                "keep it now: it is stored hashed and cannot be shown again"
            ]
        elif args.action == "revoke":
            revoked = tokens.token_summary(tokens.revoke_token(session, args.id))
            out, lines = revoked, [f"token {revoked['id']} ({revoked['name']}) revoked"]
        else:
            listed = tokens.list_tokens(session)
            out = listed
            lines = [
                f"{t['id']:>4}  {t['name']:<24} {t['scope']:<5}  created {t['created_at']}  last used {t['last_used_at'] or '-'}  "
                + ("REVOKED" if t["revoked_at"] else "")
                for t in listed
            ]
    if args.json:
        print_json(out)
    else:
        for line in lines:
            print(line)
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """This module's commands on the `zoo` parser."""
    s = sub.add_parser("init", help="create or upgrade the database schema")
    s.add_argument("--json", action="store_true", help="print a JSON object")
    s.set_defaults(func=cmd_init)

    s = sub.add_parser(
        "quickstart",
        help="build a demo zoo and store it on the embedded defaults",
        description="Builds a small digits-vit demo zoo under the data dir (80 LoRA adapters of a tiny ViT, "
        "trained with PEFT on 17 tasks), ingests it with its labels, embeds it, trains a small W2T on it and prints "
        "what was made and what to run next: about 2 minutes on 2 CPU cores. A second run reuses what exists "
        "(seconds).",
    )
    s.add_argument("--count", type=int, default=80, help="adapters in the demo zoo (default: %(default)s)")
    s.add_argument("--epochs", type=int, default=20, help="most W2T training epochs per model (default: %(default)s)")
    s.add_argument("--members", type=int, default=3, help="W2T models in the ensemble (default: %(default)s; `zoo train`: 5)")
    s.add_argument("--retrain", action="store_true", help="train W2T again even if one was trained on these adapters")
    s.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    s.add_argument("--serve", action="store_true", help="then serve the web app on http://127.0.0.1:5000/")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_quickstart)

    s = sub.add_parser(
        "make-zoo",
        help="build a reference zoo of real LoRA adapters with known attributes",
        description="Train LoRA adapters with PEFT on tasks derived from a base model the recipe "
        "pretrains once (cached under the data dir). Deterministic from --seed (workers pin the CPU "
        "kernels to AVX2 on x86-64, so AVX2 and AVX-512 machines build the same bytes), resumable "
        "(finished adapters are kept), parallel. Writes OUT_DIR/labels.csv with every "
        "generating attribute and the held-out test_accuracy. A lineage recipe (shapes-lineage) trains roots and "
        "makes children of them (rescaled, cast, truncated, pruned, merged, trained further), recording each one's "
        "relation, parents and parameters.",
    )
    s.add_argument("out_dir", metavar="OUT_DIR")
    s.add_argument("--recipe", choices=sorted(RECIPES), default="digits-vit")
    s.add_argument("--count", type=int, default=100)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes (default: %(default)s)")
    s.add_argument(
        "--mix",
        metavar="KIND=SHARE,...",
        help="a lineage recipe's share of roots, transforms, merges and continuations "
        "(default: root=0.3,transform=0.3,merge=0.2,continuation=0.2; those named replace the defaults)",
    )
    s.add_argument("--json", action="store_true", help="print the report as one JSON object")
    s.set_defaults(func=cmd_make_zoo)

    s = sub.add_parser("serve", help="serve the web app and REST API (gunicorn)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=5000)
    s.add_argument("--workers", type=int, default=2, help="processes, each with its own query engine (default: %(default)s)")
    s.add_argument(
        "--threads",
        type=int,
        default=32,
        help="threads per process; a request takes one once it has fully arrived, a chunked upload as it streams (default: %(default)s)",
    )
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("token", help="API tokens for the REST API, each of a scope: create NAME [--scope S] | list | revoke ID")
    tsub = s.add_subparsers(dest="action", required=True)
    t = tsub.add_parser("create", help="make a token (shown once)")
    t.add_argument("name")
    t.add_argument(
        "--scope",
        choices=tokens.SCOPES,
        default=tokens.DEFAULT_SCOPE,
        help="read: every read; write: also ingest and labels; admin: also delete adapters (default: %(default)s, so that a "
        "token handed out without thought cannot change the zoo)",
    )
    t.add_argument("--json", action="store_true")
    t = tsub.add_parser("list", help="tokens, without their secrets")
    t.add_argument("--json", action="store_true")
    t = tsub.add_parser("revoke", help="revoke a token by id")
    t.add_argument("id", type=int)
    t.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_token)
