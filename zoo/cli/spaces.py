"""`zoo embed`, `zoo train`, `zoo search`, `zoo predict`, `zoo index`, `zoo map`: a base model's embedding space (`zoo eval`:
zoo/cli/evaluation.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zoo.cli.render import (
    from_lineage_lines,
    human,
    label_columns,
    map_text,
    percent,
    plural,
    print_json,
    relations_line,
    table,
)
from zoo.config import Settings
from zoo.limits import DEFAULT_K, DEFAULT_MAP_POINTS, MAX_K
from zoo.store import repository
from zoo.store.blob_backends import open_blob_store
from zoo.store.blobs import BlobStore
from zoo.store.session import require_schema, session_factory

#: `--members` and `--val-fraction` of train and eval (embed.training.train_options.TrainOptions' defaults, not imported: it loads torch)
MEMBERS_HELP = "W2T models in the ensemble, from consecutive seeds (default: 5)"
UNLABELLED_HELP = (
    "with --objective both: each epoch trains on the labelled adapters and a fresh draw of at most this many unlabelled "
    "ones per labelled one, so that a zoo that is mostly unlabelled costs as its labels do (default: every adapter)"
)
VAL_FRACTION_HELP = (
    "each member's held-out share (default: 0.15); each adapter is held out by about members × this many members, "
    "whose mean the out-of-fold choices score (--members 10 --val-fraction 0.2: by two)"
)

if TYPE_CHECKING:
    from embed.serving.engine import QueryEngine
    from zoo.services.relations import RelationReport


def space_of(settings: Settings, requested: str | None) -> str:
    from embed.serving.resources import resolve_base_model

    with session_factory(settings.database_url)() as session:
        return resolve_base_model(session, requested)


def blob_store(settings: Settings) -> BlobStore:
    return open_blob_store(settings)


def query_engine(settings: Settings, device: str | None) -> QueryEngine:
    from embed.serving.engine import QueryEngine

    return QueryEngine(session_factory(settings.database_url), blob_store(settings), settings.data_dir, device)


def cmd_train(settings: Settings, args: argparse.Namespace) -> int:
    from embed.serving import embedding_resource
    from embed.training import training_resource
    from embed.training.train_options import TrainOptions

    require_schema(settings.database_url)
    space = space_of(settings, args.space)
    attributes = None if args.attributes == "all" else tuple(a for a in args.attributes.split(",") if a)
    options = TrainOptions(
        objective=args.objective,
        epochs=args.epochs,
        seed=args.seed,
        device=args.device,
        attributes=attributes,
        members=args.members,
        val_fraction=args.val_fraction,
        unlabelled_per_labelled=args.unlabelled_per_labelled,
    )
    sessions = session_factory(settings.database_url)
    info = training_resource.train_space(sessions, blob_store(settings), settings.data_dir, space, options, progress=not args.json)
    reports = embedding_resource.embed_space(sessions, blob_store(settings), settings.data_dir, space, args.device)
    info["embedded"] = {r["method"]: r["total"] for r in reports}
    if args.json:
        print_json(info)
    else:
        print(
            f"trained W2T ({info['objective']}) on {plural(info['n_adapters'], 'adapter')} of {space} in {info['train_seconds']} s, "
            f"{plural(info['members'], 'model')} ({'+'.join(map(str, info['epochs']))} epochs), "
            f"best validation loss {info['best_val_loss']:.4f}; "
            f"embedder {info['embedder_id']}, checkpoint {info['checkpoint']}"
        )
        for target, c in info["choices"].items():  # chosen out of fold: what search and predict will use
            print(f"  {target} by {c['chosen']}: {c['reason']}")
    return 0


def cmd_embed(settings: Settings, args: argparse.Namespace) -> int:
    from embed.data.dataset import base_models
    from embed.serving import embedding_resource
    from zoo.domain.probes import probes
    from zoo.memory import trim
    from zoo.services.relations import relation_engine, scan_space

    require_schema(settings.database_url)
    sessions = session_factory(settings.database_url)
    blobs = blob_store(settings)
    with sessions() as session:
        spaces = [args.space] if args.space else base_models(session)
    reports: list[embedding_resource.EmbedReport] = []
    found: dict[str, RelationReport] = {}
    for sp in spaces:  # one space at a time, its memory given back before the next: `zoo embed` holds one space's
        embedded = embedding_resource.embed_space(sessions, blobs, settings.data_dir, sp, args.device)
        probes.cache_clear()  # the space's sketch probes: the relation step draws none, another space has other modules
        trim()
        if embedded:  # an engine of its own, let go with the space
            found[sp] = scan_space(relation_engine(sessions, blobs, settings.data_dir, args.device), sessions, blobs, sp)
            trim()
        reports += embedded
    if args.json:
        print_json([{**r, "relations": found[r["space"]]} for r in reports])
        return 0
    if not reports:
        print("nothing to embed: ingest LoRA adapters first")
    for r in reports:
        print(
            f"{r['space']}: {r['method']} (embedder {r['embedder_id']}) embedded {plural(r['embedded'], 'new adapter')}, {r['total']} in "
            f"the {r['index_kind']} index ({r['index']}); module store: {r['module_store']}; map: {map_text(r['map'])}"
            + (f"; {plural(r['skipped_not_fitting'], 'adapter')} not fitting this embedder's modules" if r["skipped_not_fitting"] else "")
        )
    for report in found.values():
        print(relations_line(report))
    return 0


#: how `zoo search` and `zoo predict` read their query: decided by the text, never by which files exist
QUERY_HELP = (
    "a stored adapter's id (digits only, always an id), or any other text: a path that is read and canonicalized, "
    "not stored (a file named 1: ./1)"
)


def cmd_search(settings: Settings, args: argparse.Namespace) -> int:
    from embed.serving.refs import cli_ref
    from embed.serving.resources import search

    require_schema(settings.database_url)
    with session_factory(settings.database_url)() as session:
        filters = repository.parse_filters(args.filter)
        found = search(query_engine(settings, args.device), session, cli_ref(args.query), args.k, args.space, filters, args.method)
    if args.json:
        print_json(found)
        return 0
    used = ", ".join(str(i) for i in found["embedder_ids"])
    stage = f"; module cosine: {found['module_stage']}" if found["module_stage"] else ""
    if not found["results"]:
        print(f"no other adapter in space {found['space']} to compare {found['query_name']} with" + _filtered(filters))
    else:
        print(f"nearest to {found['query_name']} in {found['space']} by {found['method']} (embedders {used}{stage}):")
        print("\n".join(search_lines(found["results"])))
    for method, state in found["index_states"].items():
        if state != "loaded":
            print(f"note: the {method} index was {state}", file=sys.stderr)
    return 0


def _filtered(filters: dict[str, str]) -> str:
    return f" that has {', '.join(f'{k}={v}' for k, v in filters.items())}" if filters else ""


def search_lines(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """The hits as a table: score, id, name, and their given labels (the task first)."""
    header, labels = label_columns([h["labels"] for h in results])
    rows = [[f"{h['score']:.4f}", h["adapter_id"], str(h["name"])[:32], *cells] for h, cells in zip(results, labels, strict=True)]
    return table(["score", "id", "name", *header], rows, right=[True, True] + [False] * (1 + len(header)), indent="  ")


PREDICTOR_WORDS = {
    "head": "W2T heads",
    "neighbours": "most similar training adapters in the W2T embedding",
    "knn": "most similar labelled adapters",
}


def cmd_predict(settings: Settings, args: argparse.Namespace) -> int:
    from embed.serving import resources
    from embed.serving.refs import cli_ref

    require_schema(settings.database_url)
    with session_factory(settings.database_url)() as session:
        pred = resources.predict(query_engine(settings, args.device), session, cli_ref(args.query), args.space)
    if args.json:
        print_json(pred)
        return 0
    stored = pred["stored_as"]
    if stored:
        print(f"{pred['query_name']} is stored adapter {stored['adapter_id']} ({stored['name']}): answered as it")
    own = " without its own labels" if stored or pred["query"].isdigit() else ""
    print(f"{pred['query_name']} in {pred['space']}, predicted from the weights{own} (embedder {pred['embedder_id']}):")
    for key, top in pred["attributes"].items():
        c = pred["confidence"][key]
        support = f"{c['agreeing']} of {c['neighbours']} nearest labelled adapters agree" if c["neighbours"] else "no labelled neighbours"
        guesses = ", ".join(f"{t['value']} {percent(t['probability'])}" for t in top)
        if c["given"] is not None:
            verdict = "agrees" if c["agrees"] else "DISAGREES"
            print(f"  {key:<16} given {c['given']}; the prediction {verdict}: {guesses}  ({support}; {pred['predictors'][key]})")
        else:
            print(f"  {key:<16} {'' if c['sure'] else 'not sure: '}{guesses}  ({support}; {pred['predictors'][key]})")
    for key, m in pred["metrics"].items():
        interval = f"90% interval {m['low']:.3f}..{m['high']:.3f}" if m["interval"] else "no interval: no held-out residuals"
        measured = ""
        if m["measured"] is not None:
            outside = "" if m["within"] is not False else ", OUTSIDE the interval"
            measured = f"measured {m['measured']:.3f}{outside}; predicted "
        source = PREDICTOR_WORDS.get(m["predictor"], m["predictor"])
        print(f"  {key:<16} {measured}{m['value']:.3f}  ({interval}; {m['method']}: from the {source})")
    print("\n".join(from_lineage_lines(pred["from_lineage"])))
    return 0


def cmd_index(settings: Settings, args: argparse.Namespace) -> int:
    from embed.serving import index_resource

    require_schema(settings.database_url)
    with session_factory(settings.database_url)() as session, session.begin():
        info = index_resource.index_report(session, blob_store(settings), settings.data_dir, args.space, rebuild=args.action == "rebuild")
    if args.json:
        print_json(info)
        return 0
    for e in info["embedders"]:
        print(f"{info['space']}: " + ", ".join(f"{k}: {human(v)}" for k, v in e.items() if v is not None))
    print(f"{info['space']}: module store: {info['module_store']}")
    return 0


def cmd_map(settings: Settings, args: argparse.Namespace) -> int:
    from embed.serving.maps import refresh_map, space_map
    from embed.serving.resources import resolve_space

    require_schema(settings.database_url)
    with session_factory(settings.database_url)() as session:
        space = resolve_space(session, args.space)
        saved = refresh_map(session, settings.data_dir, space.id, rebuild=args.rebuild)
        found = space_map(session, settings.data_dir, space.name, args.color_by, args.limit)
    found["file"] = saved
    if args.plot:
        from zoo.plots import plot_map

        plot_map(found, Path(args.plot))
    if args.json:
        print_json(found)
        return 0
    first, second = found["explained"]
    print(
        f"{found['space']}: {found['shown']} of {plural(found['count'], 'adapter')} by {found['method']} "
        f"(embedder {found['embedder_id']}), "
        f"PCA axes holding {first:.0%} and {second:.0%} of the variance; map file: {saved}"
    )
    print("colour keys: " + (", ".join(found["color_keys"]) or "none (no given labels or test measurements)"))
    legend = found["legend"]
    if legend is not None:
        if legend["kind"] == "metric":
            spread = f"{legend['min']:.4g}..{legend['max']:.4g}" if legend["min"] is not None else "-"
        else:
            spread = ", ".join(f"{v['value']} ({v['count']})" for v in legend["values"]) or "-"
        print(f"{found['color_by']}: {spread}; {legend['missing']} shown adapters without it")
    if args.plot:
        print(f"map drawn to {args.plot}")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """This module's commands on the `zoo` parser."""
    s = sub.add_parser("embed", help="embed every adapter not yet embedded (every space, or --space) and update the indexes")
    s.add_argument("--space")
    s.add_argument("--device")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_embed)

    s = sub.add_parser("train", help="train the W2T embedder of a space and embed its adapters")
    s.add_argument("--space", help="base model (default: the only one)")
    s.add_argument("--objective", choices=["supervised", "contrastive", "both"], default="supervised")
    s.add_argument("--unlabelled-per-labelled", type=float, metavar="R", help=UNLABELLED_HELP)
    s.add_argument("--attributes", default="task", metavar="A,B|all", help="attributes that get a prediction head (default: task)")
    s.add_argument("--epochs", type=int, default=80)
    s.add_argument("--members", type=int, default=5, help=MEMBERS_HELP)
    s.add_argument("--val-fraction", type=float, default=0.15, help=VAL_FRACTION_HELP)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("search", help="the adapters most similar to a stored adapter (id) or a file/directory (path)")
    s.add_argument("query", metavar="ID_OR_PATH", help=QUERY_HELP)
    s.add_argument("-k", type=int, default=DEFAULT_K, help=f"how many results (1..{MAX_K}, default: %(default)s)")
    s.add_argument("--space")
    s.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="only adapters with this given label; also format=, rank=, source= (a prefix of the source URI) and the other fields "
        "of `zoo list --filter`; label.KEY=VALUE is always the label (label.rank=8); repeatable",
    )
    s.add_argument(
        "--method",
        help="hybrid (the default once `zoo train` has made a supervised W2T): exact module cosine and W2T cosine, "
        "mixed by the weight that retrieved best on held-out adapters, over both indexes' nearest 200; "
        "module (the default before): the module-sketch index's nearest 200 ranked by module cosine (the mean over "
        "shared modules of the per-module dW cosine, exact from the module store); dw: the same by whole-update cosine; "
        "sketch or w2t: those embeddings alone; raw (stored adapters): the factors as their files had them, sampled, "
        "which a continuation or a merge made factor by factor shares with its parents",
    )
    s.add_argument("--device")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_search)

    s = sub.add_parser("predict", help="predicted attributes (with probabilities) and performance (with an interval)")
    s.add_argument("query", metavar="ID_OR_PATH", help=QUERY_HELP)
    s.add_argument("--space")
    s.add_argument("--device")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_predict)

    s = sub.add_parser(
        "index",
        help="rebuild a space's FAISS indexes and module store from the database, or show their stats",
        description="stats: each active embedder's index (kind, size, nprobe, recall@10 against exact search on 200 of its "
        "own vectors), brought up to the database first; rebuild: build them again from the stored embeddings and blobs.",
    )
    s.add_argument("action", choices=["rebuild", "stats"])
    s.add_argument("--space")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_index)

    s = sub.add_parser(
        "map",
        help="the zoo map: a 2-D PCA of a space's embeddings (W2T if trained, else module sketches), saved, drawn or printed",
        description="Brings the space's map file up to date (new adapters are projected onto the saved axes; it is fitted "
        "again when asked, when missing or when its points more than doubled since the fit), then shows it.",
    )
    s.add_argument("--space")
    s.add_argument("--color-by", metavar="KEY", help="a given label key, or metric:NAME for a measured test metric")
    s.add_argument(
        "--limit", type=int, default=DEFAULT_MAP_POINTS, help="at most this many points, a deterministic spread (default: %(default)s)"
    )
    s.add_argument("--rebuild", action="store_true", help="fit the map again from every embedding")
    s.add_argument("--plot", metavar="PNG", help="draw the map to this image file")
    s.add_argument("--json", action="store_true", help="print the map resource as one JSON object")
    s.set_defaults(func=cmd_map)
