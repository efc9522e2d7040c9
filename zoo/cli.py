"""The `zoo` command."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from tqdm import tqdm

from zoo.blobs import BlobStore
from zoo.config import DEFAULT_ENERGY, DEFAULT_MAX_RANK, Settings
from zoo.db import repository
from zoo.db.catalog import MAX_PER_PAGE, SORTS, search_catalog
from zoo.db.session import make_engine, require_schema, session_factory, upgrade
from zoo.errors import NotFoundError, UsageError, ZooError
from zoo.labels import LabelRow, assign_rows, read_labels_csv
from zoo.reference.recipes import RECIPES

if TYPE_CHECKING:
    from zoo.ingest import IngestOptions


def _print_json(obj: object) -> None:
    print(json.dumps(obj, default=str))


def human(value: object) -> str:
    """A value as a person reads it: numbers to 4 significant digits, lists joined, nothing as "-"."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return ", ".join(human(v) for v in value)
    return str(value)


def percent(p: float) -> str:
    """A probability as a person reads it: `62%`, never a rounded `100%` or `0%` (`>99%`, `<1%`)."""
    return ">99%" if p >= 0.995 else "<1%" if p < 0.005 else f"{p:.0%}"


def plural(n: object, word: str) -> str:
    """`1 problem`, `3 problems`."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def cmd_init(settings: Settings, args: argparse.Namespace) -> int:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    info = {
        "database": make_engine(settings.database_url).url.render_as_string(hide_password=True),
        "data_dir": str(settings.data_dir),
        "status": "ok",
    }
    if args.json:
        _print_json(info)
    else:
        print(f"schema is current in {info['database']} (data in {info['data_dir']})")
    return 0


def run_ingest(
    settings: Settings,
    paths: list[str],
    options: IngestOptions,
    label_rows: dict[str, LabelRow],
    as_json: bool,
    progress: bool = True,
) -> tuple[dict[str, int], list[str]]:
    """Ingest every source under paths (and `hf://` sources), printing JSON lines or showing a progress bar.
    Returns counts by status and failures."""
    from itertools import chain

    from zoo.ingest import Ingestor, ingest_source
    from zoo.sources import hub
    from zoo.sources.local import expand_paths
    from zoo.sources.resolve import is_remote

    remote = [p for p in paths if is_remote(p)]
    for source in remote:
        hub.parse(source)  # a malformed source is a usage error before anything runs
    require_schema(settings.database_url)
    ingestor = Ingestor(session_factory(settings.database_url), BlobStore(settings.blob_dir), options)
    counts = {"ingested": 0, "duplicate": 0, "failed": 0}
    failures: list[str] = []
    sources = expand_paths([p for p in paths if not is_remote(p)])
    labels = assign_rows(label_rows, sources) if label_rows else {}
    results = chain(ingestor.ingest_many([p for p, _ in sources], labels), (ingest_source(ingestor, s) for s in remote))
    total = len(sources) + len(remote)
    with tqdm(total=total, desc="ingest", unit="adapter", disable=True if as_json or not progress else None, file=sys.stderr) as bar:
        for result in results:
            bar.update()
            counts[result.status] += 1
            if as_json:
                _print_json(result.as_dict())
            elif result.status == "failed":
                failures.append(result.error or result.source)
            elif result.revision:
                bar.write(f"{result.source} at revision {result.revision}: {result.status}, adapter {result.adapter_id}", file=sys.stdout)
            bar.set_postfix(counts)
    return counts, failures


def cmd_ingest(settings: Settings, args: argparse.Namespace) -> int:
    from zoo.ingest import IngestOptions

    if args.ray is not None:
        require_schema(settings.database_url)
        base = str(Path(args.base).absolute()) if args.base else None
        options = {"base_model": args.base_model, "base_checkpoint": base, "energy": args.energy, "max_rank": args.max_rank}
        return run_job_on_ray(settings, queue_job(settings, args.paths, options, args.labels, args.metrics, "ingest --ray"), args)
    options = IngestOptions(
        base_model=args.base_model,
        base_checkpoint=Path(args.base) if args.base else None,
        energy=args.energy,
        max_rank=args.max_rank,
        device=args.device,
    )
    label_rows = read_labels_csv(Path(args.labels), args.metrics) if args.labels else {}
    counts, failures = run_ingest(settings, args.paths, options, label_rows, args.json)
    if not args.json:
        print(f"{counts['ingested']} ingested, {counts['duplicate']} duplicate, {counts['failed']} failed")
        for f in failures:
            print(f"  failed: {f}")
    return 1 if counts["failed"] else 0


#: the demo's W2T stops a model once its validation loss has not improved for this many epochs (zoo train: 15)
QUICKSTART_PATIENCE = 5


def cmd_quickstart(settings: Settings, args: argparse.Namespace) -> int:
    """The main job on embedded defaults: build a demo zoo, store it, embed it, train W2T, say what to run next."""
    from embed import service
    from embed.train import TrainOptions
    from zoo.ingest import IngestOptions
    from zoo.reference.build import make_zoo

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    zoo_dir = settings.data_dir / "demo-zoo"
    progress = not args.json
    cache = settings.data_dir / "cache"
    report = make_zoo(zoo_dir, "digits-vit", args.count, seed=0, workers=args.workers, cache_dir=cache, progress=progress)
    counts, failures = run_ingest(settings, [str(zoo_dir)], IngestOptions(), read_labels_csv(Path(str(report["labels"]))), False, progress)
    options = TrainOptions(epochs=args.epochs, members=args.members, patience=QUICKSTART_PATIENCE)
    ready = service.prepare_space(settings, str(report["base_model"]), options, args.retrain, progress)
    if args.json:
        _print_json({"zoo": report, "ingest": counts, "database": settings.database_url, **ready})
        return _serve_after(settings, args, failures)
    _print_zoo_report(report)
    print(
        f"stored in {make_engine(settings.database_url).url.render_as_string(hide_password=True)}: "
        f"{counts['ingested']} ingested, {counts['duplicate']} already there, {counts['failed']} failed"
    )
    for f in failures:
        print(f"  failed: {f}")
    print(f"embedded {ready['embedded']} adapters (module sketch index)")
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
    print(
        "next:\n  zoo list\n  zoo show 1 --plot spectra.png\n  zoo search 1 -k 5\n  zoo predict 1\n  zoo eval\n"
        "  zoo ingest PATH_TO_YOUR_ADAPTERS --base-model NAME\n"
        f"  zoo --data-dir {settings.data_dir} serve   # then open http://127.0.0.1:5000/"
    )
    return _serve_after(settings, args, failures)


def _serve_after(settings: Settings, args: argparse.Namespace, failures: list[str]) -> int:
    if failures or not args.serve:
        return 1 if failures else 0
    from webapp.serve import serve

    print("open http://127.0.0.1:5000/ (Ctrl-C stops the server)", file=sys.stderr)
    serve(settings, "127.0.0.1", 5000, workers=1)
    return 0


def cmd_make_zoo(settings: Settings, args: argparse.Namespace) -> int:
    from zoo.reference.build import make_zoo

    report = make_zoo(
        Path(args.out_dir),
        args.recipe,
        args.count,
        seed=args.seed,
        workers=args.workers,
        cache_dir=settings.data_dir / "cache",
        progress=not args.json,
    )
    if args.json:
        _print_json(report)
    else:
        _print_zoo_report(report)
        print(f"next: zoo ingest {args.out_dir} --labels {report['labels']}")
    return 0


def _print_zoo_report(report: dict) -> None:
    acc = report["accuracy"]["overall"]
    per = report["train_seconds_per_adapter"]
    print(
        f"{report['count']} {report['recipe']} adapters in {report['out_dir']} ({report['built']} built, "
        f"{report['skipped']} already there) in {report['seconds']:.0f} s"
        + (f", {per:.2f} s of training each on {report['cpu_kernels']} CPU kernels" if per else "")
        + f"; {report['disk_bytes'] / 2**20:.1f} MiB"
    )
    print(f"test accuracy: mean {acc['mean']:.3f}, std {acc['std']:.3f}, range {acc['min']:.3f}..{acc['max']:.3f}")
    tasks = report["accuracy"]["by"].get("task", {})
    if tasks:
        print(f"  {'task':<16} {'adapters: mean':>14}  {'range':<12} {'n':>3}  {'chance':>6}  {'base model alone':>16}")
    for value, s in tasks.items():
        base = f"{s['base']:.3f}" if s.get("base") is not None else "-"
        print(f"  {value:<16} {s['mean']:>14.3f}  {s['min']:.3f}..{s['max']:.3f} {s['n']:>3}  {s['chance']:>6.3f}  {base:>16}")
    if tasks:
        print("  (held-out test accuracy; docs/reference-zoos.md says why some tasks stay low)")


def cmd_list(settings: Settings, args: argparse.Namespace) -> int:
    require_schema(settings.database_url)
    filters = repository.parse_filters(args.filter)
    if args.base_model:
        filters.setdefault("base_model", args.base_model)
    with session_factory(settings.database_url)() as session:
        found = search_catalog(session, args.query, filters, args.sort, args.page, args.per_page)
    if args.json:
        _print_json(found)
        return 0
    total, rows = found["total"], found["results"]
    if not rows:
        if total:
            print(f"page {args.page} is past the last page of {total} adapters")
        else:
            print("no adapters match" if args.query or filters else "no adapters yet: add some with `zoo ingest PATH`")
        return 0
    print(f"{'id':>5}  {'name':<32} {'format':<16} {'rank':>4}  {'base model':<28} hash")
    for r in rows:
        print(
            f"{r['id']:>5}  {str(r['name'])[:32]:<32} {r['format']:<16} {r['rank'] or '-':>4}  "
            f"{str(r['base_model'])[:28]:<28} {str(r['canonical_hash'])[:12]}"
        )
    pages = -(-total // args.per_page)
    if pages > 1:
        print(f"page {args.page} of {pages} ({total} adapters, sorted by {found['sort']}): --page N for another")
    return 0


def cmd_show(settings: Settings, args: argparse.Namespace) -> int:
    require_schema(settings.database_url)
    with session_factory(settings.database_url)() as session:
        adapter = repository.get_adapter(session, args.id, with_modules=True)
        if adapter is None:
            raise NotFoundError(f"no adapter with id {args.id}: see `zoo list`")
        detail = repository.adapter_detail(adapter)
    if args.plot:
        from zoo.plots import plot_spectra

        plot_spectra(str(detail["name"]), detail["modules"], Path(args.plot))  # type: ignore[arg-type]
    if args.json:
        _print_json(detail)
        return 0
    if args.plot:
        print(f"spectra drawn to {args.plot}")
    for key in (
        "id",
        "name",
        "base_model",
        "format",
        "rank",
        "alpha",
        "task_type",
        "target_modules",
        "canonical_hash",
        "dw_norm",
        "file_sha256",
        "size_bytes",
        "source_uri",
        "source_revision",
        "author",
    ):
        print(f"{key:>15}: {human(detail[key])}")
    for note in detail["notes"]:  # type: ignore[attr-defined]
        print(f"{'note':>15}: {note}")
    for key, value in detail["labels"].items():  # type: ignore[attr-defined]
        print(f"{key:>15}: {value}  (label)")
    for key, value in detail["measurements"].items():  # type: ignore[attr-defined]
        print(f"{key:>15}: {value:.4g}  (measured)")
    print()
    print(f"{'module':<48} {'shape':>12} {'r':>3} {'k':>3} {'σ_max':>9} {'‖·‖_F':>9} {'stable':>7} {'eff':>6} {'α_PL':>6}")
    for m in detail["modules"]:  # type: ignore[attr-defined]
        shape = "x".join(map(str, m["shape"]))
        alpha = f"{m['power_law_alpha']:.2f}" if m["power_law_alpha"] is not None else "-"
        print(
            f"{m['name'][-48:]:<48} {shape:>12} {m['rank'] or '-':>3} {m['canonical_rank'] or '-':>3} "
            f"{m['spectral_norm']:>9.3g} {m['frobenius_norm']:>9.3g} {m['stable_rank']:>7.2f} "
            f"{m['effective_rank']:>6.2f} {alpha:>6}"
        )
    return 0


def cmd_lineage(settings: Settings, args: argparse.Namespace) -> int:
    from zoo.lineage import lineage

    require_schema(settings.database_url)
    with session_factory(settings.database_url)() as session:
        found = lineage(session, args.id)
    if args.json:
        _print_json(found)
    else:
        print("\n".join(lineage_lines(found)))
    return 0


def lineage_lines(found: dict) -> list[str]:
    """The lineage resource as a readable tree."""

    def ref(a: dict) -> str:
        by = f"  by {a['author']}" if a["author"] else ""
        at = f"  @ {a['source_revision'][:12]}" if a["source_revision"] else ""
        return f"#{a['id']} {a['name']}{by}{at}"

    def tree(nodes: list[dict], indent: str) -> list[str]:
        out = []
        for i, n in enumerate(nodes):
            last = i == len(nodes) - 1
            notes = [f"stored as #{n['adapter_id']}" if n["adapter_id"] else ""]
            notes += ["cycle: not followed" if n["cycle"] else "", "more above, not shown" if n["truncated"] else ""]
            shown = ", ".join(x for x in notes if x)
            of = f"{n['relation']} of " if n["relation"] else ""
            out.append(f"{indent}{'└─' if last else '├─'} {of}{n['model']}{f'  ({shown})' if shown else ''}")
            out += tree(n["base_models"], indent + ("   " if last else "│  "))
        return out

    me = found["adapter"]
    lines = [f"{ref(me)}  {me['source_uri']}", "base models:"]
    lines += tree(found["base_models"], "  ") or ["  none known"]
    older, newer = found["versions"]["older"], found["versions"]["newer"]
    if older or newer:
        lines.append("versions (oldest first):")
        for a, mark in [*((a, "") for a in reversed(older)), (me, "  ← this one"), *((a, "") for a in newer)]:
            when = a["last_modified"] or a["created_at"] or ""
            lines.append(f"  {ref(a)}  {when}{mark}")
    for key, title in (("same_base_model", "same base model"), ("same_author", "same author"), ("same_source", "same source")):
        group = found[key]
        if group["value"] is None:
            continue
        total = f"{group['total']}{'+' if group['capped'] else ''}"
        shown = f", the newest {len(group['adapters'])}" if len(group["adapters"]) < group["total"] else ""
        lines.append(f"{title} {group['value']}: {total} other{'' if group['total'] == 1 else 's'}{shown}")
        lines += [f"  {ref(a)}" for a in group["adapters"]]
    return lines


def cmd_export(settings: Settings, args: argparse.Namespace) -> int:
    from zoo.export import export_files, export_notes, export_zip, load_for_export

    require_schema(settings.database_url)
    with session_factory(settings.database_url)() as session:
        factors, meta = load_for_export(session, _blobs(settings), args.id)
    out = Path(args.out)
    if args.format == "peft" and out.suffix == ".zip":
        targets = {out: export_zip(factors, meta)}
    else:
        targets = _export_targets(out, args.format, export_files(factors, meta, args.format))
    _write_new(targets)
    info = {
        "adapter_id": meta.adapter_id,
        "name": meta.name,
        "format": args.format,
        "files": [str(p) for p in targets],
        "size_bytes": sum(len(data) for data in targets.values()),
        "notes": export_notes(meta),
    }
    if args.json:
        _print_json(info)
        return 0
    print(f"adapter {meta.adapter_id} ({meta.name}) exported as {args.format}: {', '.join(info['files'])}")  # type: ignore[arg-type]
    for note in info["notes"]:  # type: ignore[attr-defined]
        print(f"note: {note}")
    return 0


def _export_targets(out: Path, fmt: str, files: dict[str, bytes]) -> dict[Path, bytes]:
    """Where each exported file goes: into --out for a PEFT directory or an existing directory, else to --out itself."""
    if fmt == "peft" or out.is_dir():
        return {out / name: data for name, data in files.items()}
    (data,) = files.values()
    return {out: data}


def _write_new(targets: dict[Path, bytes]) -> None:
    """Write every file, refusing to replace any file that exists."""
    taken = [str(p) for p in targets if p.exists()]
    if taken:
        raise UsageError(f"{taken[0]} exists: choose another --out")
    for path, data in targets.items():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("xb") as fh:
                fh.write(data)
        except OSError as exc:
            raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None


def _space(settings: Settings, requested: str | None) -> str:
    from embed.service import resolve_base_model

    with session_factory(settings.database_url)() as session:
        return resolve_base_model(session, requested)


def _blobs(settings: Settings) -> BlobStore:
    return BlobStore(settings.blob_dir)


def _engine(settings: Settings, device: str | None):  # type: ignore[no-untyped-def]
    from embed.engine import QueryEngine

    return QueryEngine(session_factory(settings.database_url), _blobs(settings), settings.data_dir, device)


def cmd_train(settings: Settings, args: argparse.Namespace) -> int:
    from embed import service
    from embed.train import TrainOptions

    require_schema(settings.database_url)
    space = _space(settings, args.space)
    attributes = None if args.attributes == "all" else tuple(a for a in args.attributes.split(",") if a)
    options = TrainOptions(
        objective=args.objective, epochs=args.epochs, seed=args.seed, device=args.device, attributes=attributes, members=args.members
    )
    sessions = session_factory(settings.database_url)
    info = service.train_space(sessions, _blobs(settings), settings.data_dir, space, options, progress=not args.json)
    reports = service.embed_space(sessions, _blobs(settings), settings.data_dir, space, args.device)
    info["embedded"] = {r["method"]: r["total"] for r in reports}
    if args.json:
        _print_json(info)
    else:
        print(
            f"trained W2T ({info['objective']}) on {info['n_adapters']} adapters of {space} in {info['train_seconds']} s, "
            f"{info['members']} models ({'+'.join(map(str, info['epochs']))} epochs), best validation loss {info['best_val_loss']:.4f}; "
            f"embedder {info['embedder_id']}, checkpoint {info['checkpoint']}"
        )
        for target, c in info["choices"].items():  # chosen out of fold: what search and predict will use
            print(f"  {target} by {c['chosen']}: {c['reason']}")
    return 0


def cmd_embed(settings: Settings, args: argparse.Namespace) -> int:
    from embed import service
    from embed.dataset import base_models

    require_schema(settings.database_url)
    sessions = session_factory(settings.database_url)
    with sessions() as session:
        spaces = [args.space] if args.space else base_models(session)
    reports = [r for sp in spaces for r in service.embed_space(sessions, _blobs(settings), settings.data_dir, sp, args.device)]
    if args.json:
        _print_json(reports)
        return 0
    if not reports:
        print("nothing to embed: ingest LoRA adapters first")
    for r in reports:
        print(
            f"{r['space']}: {r['method']} (embedder {r['embedder_id']}) embedded {r['embedded']} new adapters, {r['total']} in the "
            f"{r['index_kind']} index ({r['index']}); module store: {r['module_store']}; map: {r['map']}"
            + (f"; {r['skipped_not_fitting']} do not fit this embedder's modules" if r["skipped_not_fitting"] else "")
        )
    return 0


def cmd_search(settings: Settings, args: argparse.Namespace) -> int:
    from embed import service

    require_schema(settings.database_url)
    with session_factory(settings.database_url)() as session:
        filters = repository.parse_filters(args.filter)
        found = service.search(_engine(settings, args.device), session, args.query, args.k, args.space, filters, args.method)
    if args.json:
        _print_json(found)
        return 0
    used = ", ".join(str(i) for i in found["embedder_ids"])  # type: ignore[attr-defined]
    stage = f"; module cosine: {found['module_stage']}" if found["module_stage"] else ""
    print(f"nearest to {found['query_name']} in {found['space']} by {found['method']} (embedders {used}{stage}):")
    for h in found["results"]:  # type: ignore[attr-defined]
        print(f"  {h['score']:7.4f}  {h['adapter_id']:>6}  {h['name']:<32} {h['labels'].get('task', '')}")
    for method, state in found["index_states"].items():  # type: ignore[attr-defined]
        if state != "loaded":
            print(f"note: the {method} index was {state}", file=sys.stderr)
    return 0


PREDICTOR_WORDS = {
    "head": "W2T heads",
    "neighbours": "most similar training adapters in the W2T embedding",
    "knn": "most similar labelled adapters",
}


def cmd_predict(settings: Settings, args: argparse.Namespace) -> int:
    from embed import service

    require_schema(settings.database_url)
    with session_factory(settings.database_url)() as session:
        pred = service.predict(_engine(settings, args.device), session, args.query, args.space)
    if args.json:
        _print_json(pred)
        return 0
    print(f"{pred['query_name']} in {pred['space']} (embedder {pred['embedder_id']}):")
    for key, top in pred["attributes"].items():  # type: ignore[attr-defined]
        c = pred["confidence"][key]  # type: ignore[index]
        verdict = "" if c["sure"] else "not sure: "
        support = f"{c['agreeing']} of {c['neighbours']} nearest labelled adapters agree" if c["neighbours"] else "no labelled neighbours"
        print(f"  {key:<16} {verdict}" + ", ".join(f"{t['value']} {percent(t['probability'])}" for t in top) + f"  ({support})")
    for key, m in pred["metrics"].items():  # type: ignore[attr-defined]
        interval = f"90% interval {m['low']:.3f}..{m['high']:.3f}" if m["interval"] else "no interval: no held-out residuals"
        print(f"  {key:<16} {m['value']:.3f}  ({interval}; {m['method']}: from the {PREDICTOR_WORDS.get(m['predictor'], m['predictor'])})")
    return 0


def cmd_index(settings: Settings, args: argparse.Namespace) -> int:
    from embed import service

    require_schema(settings.database_url)
    with session_factory(settings.database_url)() as session, session.begin():
        info = service.index_report(session, _blobs(settings), settings.data_dir, args.space, rebuild=args.action == "rebuild")
    if args.json:
        _print_json(info)
        return 0
    for e in info["embedders"]:  # type: ignore[attr-defined]
        print(f"{info['space']}: " + ", ".join(f"{k}: {human(v)}" for k, v in e.items() if v is not None))
    print(f"{info['space']}: module store: {info['module_store']}")
    return 0


def cmd_map(settings: Settings, args: argparse.Namespace) -> int:
    from embed.maps import refresh_map, space_map
    from embed.service import resolve_space

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
        _print_json(found)
        return 0
    first, second = found["explained"]  # type: ignore[misc]
    print(
        f"{found['space']}: {found['shown']} of {found['count']} adapters by {found['method']} (embedder {found['embedder_id']}), "
        f"PCA axes holding {first:.0%} and {second:.0%} of the variance; map file: {saved}"
    )
    print("colour keys: " + (", ".join(found["color_keys"]) or "none (no given labels or test measurements)"))  # type: ignore[arg-type]
    legend: dict | None = found["legend"]  # type: ignore[assignment]
    if legend is not None:
        if legend["kind"] == "metric":
            spread = f"{legend['min']:.4g}..{legend['max']:.4g}" if legend["min"] is not None else "-"
        else:
            spread = ", ".join(f"{v['value']} ({v['count']})" for v in legend["values"]) or "-"
        print(f"{found['color_by']}: {spread}; {legend['missing']} shown adapters without it")
    if args.plot:
        print(f"map drawn to {args.plot}")
    return 0


def cmd_eval(settings: Settings, args: argparse.Namespace) -> int:
    from embed.dataset import load_adapters
    from embed.evaluate import combine_splits, evaluate, format_table
    from embed.train import TrainOptions
    from embed.types import schema_of

    if args.splits < 1:
        raise UsageError(f"--splits must be at least 1, got {args.splits}")
    per_task, fraction = args.labelled_per_task, args.label_fraction
    if per_task is not None and per_task < 1 or fraction is not None and not 0 < fraction < 1:
        raise UsageError("--labelled-per-task must be at least 1 and --label-fraction between 0 and 1")
    require_schema(settings.database_url)
    space = _space(settings, args.space)
    with session_factory(settings.database_url)() as session:
        adapters = load_adapters(session, BlobStore(settings.blob_dir), space)
    if len(adapters) < 10:
        raise UsageError(f"space {space} has {len(adapters)} adapters: evaluation needs at least 10")
    results = []
    for seed in range(args.seed, args.seed + args.splits):
        options = TrainOptions(epochs=args.epochs, seed=seed, device=args.device, members=args.members)
        results.append(
            evaluate(
                adapters,
                schema_of(space, adapters),
                options,
                args.test_fraction,
                seed,
                progress=not args.json,
                contrastive=not args.no_contrastive,
                labelled_per_task=args.labelled_per_task,
                label_fraction=args.label_fraction,
                objective=args.objective,
            )
        )
    result = results[0] if len(results) == 1 else combine_splits(results)
    if args.json:
        _print_json(result)
    else:
        print(format_table(result))
    return 0


def cmd_check(settings: Settings, args: argparse.Namespace) -> int:
    from zoo.check import check

    require_schema(settings.database_url)
    report = check(settings, repair=args.repair, grace_s=args.grace)
    if args.json:
        _print_json(report)
    else:
        b = report["blobs"]
        print(
            f"{b['rows']} adapters with blobs: {len(b['missing'])} missing, {len(b['corrupt'])} corrupt; "  # type: ignore[index]
            f"{len(report['orphans'])} orphan blobs, {len(report['temporary_files'])} temporary files "  # type: ignore[arg-type]
            f"({report['in_flight']} younger than {args.grace:g} s left alone), {report['removed']} removed"
        )
        for entry in report["indexes"]:  # type: ignore[attr-defined]
            if entry["state"] != "ok":
                what = "map" if "map" in entry else f"{entry['method']} index" if "method" in entry else "module store"
                done = " (rebuilt)" if entry.get("repaired") else ""
                print(f"  {entry['space']}: {what}: {entry['state']}{done}")
        for entry in report["unembedded"]:  # type: ignore[attr-defined]
            print(f"  {entry['space']}: {entry['count']} adapters not embedded" + (" (embedded now)" if entry.get("repaired") else ""))
        for line in report["repaired"]:  # type: ignore[attr-defined]
            print(f"  repaired: {line}")
        lost = [*b["missing"], *b["corrupt"]]  # type: ignore[index]
        for x in lost:
            print(f"  adapter {x['adapter_id']}: blob {x['blob']} is missing or corrupt: ingest it again")
        print("ok" if report["ok"] else plural(report["problems"], "problem") + ("" if args.repair else ": run `zoo check --repair`"))
    return 0 if report["ok"] else 1


def cmd_jobs(settings: Settings, args: argparse.Namespace) -> int:
    from zoo import jobs

    require_schema(settings.database_url)
    sessions = session_factory(settings.database_url)
    if args.action == "add":
        job_id = queue_job(settings, args.paths, {"base_model": args.base_model}, args.labels, args.metrics, "cli")
        with sessions() as session:
            out: object = jobs.get_job(session, job_id, items=False)
    elif args.action == "retry":
        out = jobs.retry_job(sessions, args.id)
    elif args.action == "cancel":
        out = jobs.cancel_job(sessions, args.id)
    else:
        with sessions() as session:
            out = jobs.list_jobs(session, args.limit) if args.action == "list" else jobs.get_job(session, args.id)
    if args.json:
        _print_json(out)
    elif args.action == "list":
        print("\n".join(job_list_lines(out)) if out else "no jobs yet: `zoo jobs add PATH...` queues one for `zoo worker`")  # type: ignore[arg-type]
    else:
        print("\n".join(job_lines(out)))  # type: ignore[arg-type]
    return 0


def queue_job(
    settings: Settings, paths: list[str], options: dict[str, object], labels_csv: str | None, metrics: Sequence[str], created_by: str
) -> int:
    """Queue the sources under `paths` (local or `hf://`) as one job, with their labels CSV rows; its id."""
    from zoo import jobs
    from zoo.sources.resolve import job_sources

    label_rows = read_labels_csv(Path(labels_csv), metrics) if labels_csv else {}
    sources, labels = job_sources(paths, label_rows)
    with session_factory(settings.database_url).begin() as session:
        return jobs.create_job(session, sources, {k: v for k, v in options.items() if v is not None}, created_by, labels).id


def cmd_crawl(settings: Settings, args: argparse.Namespace) -> int:
    from zoo import jobs
    from zoo.sources.hub import crawl

    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit must be at least 1")
    require_schema(settings.database_url)
    sources = crawl(args.base_model, search=args.search, author=args.author, library=args.library, limit=args.limit)
    with session_factory(settings.database_url).begin() as session:
        job = jobs.create_job(session, sources, {}, "crawl")
        out = {**jobs.job_detail(session, job, items=False), "sources": sources}
    if args.ray is not None:
        return run_job_on_ray(settings, int(out["id"]), args)  # type: ignore[call-overload]
    if args.json:
        _print_json(out)
    else:
        print(f"job {out['id']}: {len(sources)} adapters of {args.base_model} queued; run `zoo worker --drain`")
    return 0


def run_job_on_ray(settings: Settings, job_id: int, args: argparse.Namespace) -> int:
    """Work a queued job on Ray (zoo/ray_runner.py); print the worker's summary and the failed items."""
    from zoo.jobs import get_job
    from zoo.ray_runner import run_on_ray

    device, progress = getattr(args, "device", None), False if args.json else None
    summary = run_on_ray(settings, job_id, args.ray or None, args.concurrency, device=device, progress=progress)
    with session_factory(settings.database_url)() as session:
        job = get_job(session, job_id)
    failed = [i for i in job["items"] if i["state"] == "failed"]  # type: ignore[union-attr]
    if args.json:
        _print_json({**summary, "job": {k: v for k, v in job.items() if k != "items"}, "failures": failed})
    else:
        ray = summary["ray"]
        print(f"job {job_id} on Ray ({ray['nodes']} nodes, {ray['cpus']} CPUs, {ray['gpus']:g} GPUs): " + worker_line(summary))  # type: ignore[index]
        for item in failed:
            print(f"  failed: {item['reason'] or item['source']}")
    return 1 if failed else 0


def worker_line(summary: dict[str, object]) -> str:
    """A worker run's summary in one line."""
    embedded = ", ".join(f"{n} in {space}" for space, n in summary["embedded"].items()) or "none"  # type: ignore[attr-defined]
    return (
        f"{plural(summary['processed'], 'item')} in {summary['ingest_seconds']:.1f} s ({summary['items_per_s'] or 0:.2f} items/s), "
        f"{summary['seconds']:.1f} s with embedding: "
        f"{summary['done']} done, {summary['duplicate']} duplicate, {summary['failed']} failed"
        + (f", {summary['queued']} queued again" if summary["queued"] else "")
        + (f", {summary['lost']} taken over by another worker" if summary["lost"] else "")
        + f"; embedded: {embedded}"
    )


def job_list_lines(found: list[dict]) -> list[str]:
    lines = [
        f"{'id':>5}  {'state':<9} {'total':>6} {'done':>6} {'dup':>5} {'failed':>6} {'queued':>6} {'running':>7} {'items/s':>8}  created"
    ]
    for j in found:
        c = j["counts"]
        rate = f"{j['throughput']:.2f}" if j["throughput"] else "-"
        lines.append(
            f"{j['id']:>5}  {j['state']:<9} {c['total']:>6} {c['done']:>6} {c['duplicate']:>5} {c['failed']:>6} {c['queued']:>6} "
            f"{c['running']:>7} {rate:>8}  {str(j['created_at'])[:19]}"
        )
    return lines


def job_lines(j: dict) -> list[str]:
    """A job resource as text: counts, throughput and ETA, stage means, failed items."""
    from zoo.jobs import ITEM_STATES

    c = j["counts"]
    when = f"created {str(j['created_at'])[:19]}" + (f", finished {str(j['finished_at'])[:19]}" if j["finished_at"] else "")
    lines = [f"job {j['id']}: {j['state']} ({j['kind']}, by {j['created_by'] or '-'}, {when})"]
    lines.append(f"  {c['total']} items: " + ", ".join(f"{c[s]} {s}" for s in ITEM_STATES if c[s] or s in ("done", "failed")))
    if j["throughput"]:
        eta = f"; ETA {j['eta_s']:.0f} s" if j["eta_s"] is not None else ""
        lines.append(f"  {j['processed']} processed in {j['elapsed_s']:.1f} s: {j['throughput']:.2f} items/s{eta}")
    if j.get("stages"):
        total = sum(j["stages"].values())
        means = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in j["stages"].items())
        slowest = j["slowest_stage"]
        lines.append(f"  per item: {means}; slowest stage: {slowest} ({j['stages'][slowest] / total:.0%})")
    for key in ("requeued", "cancelled_items"):
        if key in j:
            lines.append(f"  {j[key]} items {'queued again' if key == 'requeued' else 'cancelled'}")
    failed = [i for i in j.get("items", []) if i["state"] == "failed"]
    if failed:
        lines.append("  failed (`zoo jobs retry` queues them again):")
        lines += [f"    #{i['id']} {i['reason'] or i['source']}" for i in failed]
    return lines


def cmd_worker(settings: Settings, args: argparse.Namespace) -> int:
    import signal
    import threading

    from zoo.jobs import get_job
    from zoo.worker import WorkerOptions, run_worker

    require_schema(settings.database_url)
    if args.concurrency < 1 or args.embed_every < 1:
        raise UsageError("--concurrency and --embed-every must be at least 1")
    if args.job is not None:
        with session_factory(settings.database_url)() as session:
            get_job(session, args.job, items=False)
    stop = threading.Event()

    def on_signal(_signum: int, _frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print("zoo worker: stopping once the items in hand are finished (again to quit now)", file=sys.stderr)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        options = WorkerOptions(job_id=args.job, drain=args.drain, device=args.device)
        summary = run_worker(settings, options, args.concurrency, args.embed_every, progress=False if args.json else None, stop=stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if args.json:
        _print_json(summary)
        return 0
    print(worker_line(summary))
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
    from zoo import tokens

    require_schema(settings.database_url)
    with session_factory(settings.database_url).begin() as session:
        if args.action == "create":
            row, token = tokens.create_token(session, args.name)
            out: object = {**tokens.token_summary(row), "token": token}
        elif args.action == "revoke":
            out = tokens.token_summary(tokens.revoke_token(session, args.id))
        else:
            out = tokens.list_tokens(session)
    if args.json:
        _print_json(out)
    elif args.action == "create":
        print(f"token {out['id']} ({out['name']}): {out['token']}\nkeep it now: it is stored hashed and cannot be shown again")  # type: ignore[index]
    elif args.action == "revoke":
        print(f"token {out['id']} ({out['name']}) revoked")  # type: ignore[index]
    else:
        for t in out:  # type: ignore[attr-defined]
            revoked = "REVOKED" if t["revoked_at"] else ""
            print(f"{t['id']:>4}  {t['name']:<24} created {t['created_at']}  last used {t['last_used_at'] or '-'}  {revoked}")
    return 0


def add_ray_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="queue the sources as a job and work it on a Ray cluster (needs the `ray` extra): ADDRESS as ray.init takes it "
        "(e.g. auto, HOST:6379, ray://HOST:10001); none: RAY_ADDRESS, or a new local instance on this machine's cores. "
        "Progress is in the job (`zoo jobs show`); more than one node needs PostgreSQL and a data dir every node mounts",
    )
    s.add_argument("--concurrency", type=int, metavar="N", help="with --ray: ingest tasks (default: one per CPU of the cluster)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zoo",
        description="A weight-space model zoo: ingest LoRA adapters and checkpoints, canonicalize and describe them.",
    )
    p.add_argument("--db", metavar="URL", help="database URL (default: $ZOO_DATABASE_URL, else SQLite under the data dir)")
    p.add_argument("--data-dir", metavar="DIR", help="data directory for the blob store (default: $ZOO_DATA_DIR or ~/.local/share/zoo)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("init", help="create or upgrade the database schema")
    s.add_argument("--json", action="store_true", help="print a JSON object")
    s.set_defaults(func=cmd_init)

    s = sub.add_parser(
        "ingest",
        help="read, canonicalize, describe and store adapters",
        description="Ingest PEFT adapter directories, kohya/diffusers LoRA .safetensors files and full "
        "checkpoints. A directory of adapters is searched recursively. Every source is tried; "
        "the exit status is 1 if any failed.",
    )
    s.add_argument("paths", nargs="+", metavar="PATH")
    s.add_argument("--base-model", metavar="NAME", help="base model name to record (overrides the files)")
    s.add_argument("--base", metavar="PATH", help="base checkpoint: full checkpoints are stored as low-rank deltas against it")
    s.add_argument(
        "--energy", type=float, default=DEFAULT_ENERGY, help="checkpoint deltas: energy fraction the rank must keep (default %(default)s)"
    )
    s.add_argument("--max-rank", type=int, default=DEFAULT_MAX_RANK, help="checkpoint deltas: largest rank (default %(default)s)")
    s.add_argument("--device", help="torch device for canonicalization (default: cuda if available, else cpu)")
    s.add_argument(
        "--labels",
        metavar="CSV",
        help="attach known attributes and measurements: a CSV with a 'name' column "
        "(adapter directory or file name); test_accuracy and --metrics columns are measurements",
    )
    s.add_argument(
        "--metrics",
        type=lambda v: [c for c in v.split(",") if c],
        default=[],
        metavar="COL,...",
        help="further numeric CSV columns to store as measurements",
    )
    add_ray_arguments(s)
    s.add_argument("--json", action="store_true", help="one JSON object per source, no progress bar (with --ray: one summary)")
    s.set_defaults(func=cmd_ingest)

    s = sub.add_parser(
        "make-zoo",
        help="build a reference zoo of real LoRA adapters with known attributes",
        description="Train LoRA adapters with PEFT on tasks derived from a base model the recipe "
        "pretrains once (cached under the data dir). Deterministic from --seed (workers pin the CPU "
        "kernels to AVX2 on x86-64, so AVX2 and AVX-512 machines build the same bytes), resumable "
        "(finished adapters are kept), parallel. Writes OUT_DIR/labels.csv with every "
        "generating attribute and the held-out test_accuracy.",
    )
    s.add_argument("out_dir", metavar="OUT_DIR")
    s.add_argument("--recipe", choices=sorted(RECIPES), default="digits-vit")
    s.add_argument("--count", type=int, default=100)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes (default: %(default)s)")
    s.add_argument("--json", action="store_true", help="print the report as one JSON object")
    s.set_defaults(func=cmd_make_zoo)

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
        "eval",
        help="compare W2T embeddings with training-free baselines on a held-out split",
        description="Splits the space's adapters (seeded, by adapter), trains W2T (supervised and "
        "contrastive) on the training part and scores every method on the held-out part: "
        "task accuracy and macro-F1, test-accuracy MAE/Spearman/Kendall, retrieval "
        "Hit@1/Hit@10/MRR/nDCG@10 (relevance = same task).",
    )
    s.add_argument("--space", help="base model (default: the only one)")
    s.add_argument("--epochs", type=int, default=80)
    s.add_argument("--members", type=int, default=5, help="W2T models in the ensemble, from consecutive seeds (default: 5)")
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
    s.add_argument("--seed", type=int, default=0, help="seed of the split and of the W2T members (default: 0)")
    s.add_argument(
        "--splits",
        type=int,
        default=1,
        help="evaluate on this many splits (seeds SEED, SEED+1, ...) and report mean ± std over them (default: 1)",
    )
    s.add_argument(
        "--no-contrastive",
        action="store_true",
        help="leave W2T (contrastive) out (its row is null): about half the training time",
    )
    s.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=cmd_eval)

    s = sub.add_parser("train", help="train the W2T embedder of a space and embed its adapters")
    s.add_argument("--space", help="base model (default: the only one)")
    s.add_argument("--objective", choices=["supervised", "contrastive", "both"], default="supervised")
    s.add_argument("--attributes", default="task", metavar="A,B|all", help="attributes that get a prediction head (default: task)")
    s.add_argument("--epochs", type=int, default=80)
    s.add_argument("--members", type=int, default=5, help="W2T models in the ensemble, from consecutive seeds (default: 5)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("embed", help="embed every adapter not yet embedded (every space, or --space) and update the indexes")
    s.add_argument("--space")
    s.add_argument("--device")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_embed)

    s = sub.add_parser("search", help="the adapters most similar to a stored adapter (id) or a file/directory (path)")
    s.add_argument("query", metavar="ID_OR_PATH", help="a stored adapter id, or a path that is read and canonicalized, not stored")
    s.add_argument("-k", type=int, default=10, help="how many results (1..1000, default: %(default)s)")
    s.add_argument("--space")
    s.add_argument(
        "--filter",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="only adapters with this given label; also format=, rank= and source= (a prefix of the source URI); repeatable",
    )
    s.add_argument(
        "--method",
        help="hybrid (the default once `zoo train` has made a supervised W2T): exact module cosine and W2T cosine, "
        "mixed by the weight that retrieved best on held-out adapters, over both indexes' nearest 200; "
        "module (the default before): the module-sketch index's nearest 200 ranked by module cosine (the mean over "
        "shared modules of the per-module dW cosine, exact from the module store); sketch or w2t: those embeddings alone",
    )
    s.add_argument("--device")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_search)

    s = sub.add_parser("predict", help="predicted attributes (with probabilities) and performance (with an interval)")
    s.add_argument("query", metavar="ID_OR_PATH")
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
    s.add_argument("--limit", type=int, default=5000, help="at most this many points, a deterministic spread (default: %(default)s)")
    s.add_argument("--rebuild", action="store_true", help="fit the map again from every embedding")
    s.add_argument("--plot", metavar="PNG", help="draw the map to this image file")
    s.add_argument("--json", action="store_true", help="print the map resource as one JSON object")
    s.set_defaults(func=cmd_map)

    s = sub.add_parser(
        "list",
        help="list and search stored adapters: free text, filters, sorts, pages",
        description="Searches names, base model, labels (keys and values), tags, model cards and source URIs: "
        "words are AND-ed, punctuated words are phrases (task=even, digits-vit-00012), the last word is a prefix.",
    )
    s.add_argument("--query", "-q", metavar="TEXT", help="free text")
    s.add_argument("--filter", action="append", default=[], metavar="KEY=VALUE", help="base_model, format, rank, source (prefix), label")
    s.add_argument("--base-model", metavar="NAME", help="same as --filter base_model=NAME")
    s.add_argument("--sort", choices=SORTS, help="default: relevance with --query, else newest")
    s.add_argument("--page", type=int, default=1)
    s.add_argument("--per-page", type=int, default=20, help=f"at most {MAX_PER_PAGE} (default %(default)s)")
    s.add_argument("--json", action="store_true", help="print the whole result: page, total and facets")
    s.set_defaults(func=cmd_list)

    s = sub.add_parser(
        "check",
        help="verify blobs against rows, find orphans and temporary files, check indexes and embeddings (exit 1 if anything is wrong)",
    )
    s.add_argument("--repair", action="store_true", help="remove orphans and temporary files, rebuild indexes, embed what is missing")
    s.add_argument(
        "--grace", type=float, default=3600.0, metavar="SECONDS", help="leave files younger than this alone (default: %(default)s)"
    )
    s.add_argument("--json", action="store_true", help="print a JSON object")
    s.set_defaults(func=cmd_check)

    s = sub.add_parser(
        "export",
        help="write a stored LoRA adapter as a PEFT directory (or .zip), a diffusers or a kohya .safetensors file",
        description="Rebuilt from the canonical form: B = U·√S, A = √S·Vᵀ at the canonical rank with alpha = rank "
        "(scaling 1), so the file's update is the stored one and ingesting it again finds the stored adapter. "
        "Checkpoints, DoRA adapters and conv modules are refused; existing files are never replaced.",
    )
    s.add_argument("id", type=int)
    s.add_argument("--format", required=True, metavar="peft|diffusers|kohya")
    s.add_argument(
        "--out",
        required=True,
        metavar="PATH",
        help="peft: a directory, or a .zip file; diffusers and kohya: a .safetensors file, or an existing directory to write it in",
    )
    s.add_argument("--json", action="store_true", help="print a JSON object")
    s.set_defaults(func=cmd_export)

    s = sub.add_parser(
        "jobs",
        help="ingestion jobs: add PATH... | list | show ID | retry ID | cancel ID",
        description="A job is a list of sources with a state per item, kept in the database: `zoo worker` processes, "
        "the web app's ingest endpoint and `zoo crawl` make them. Re-running a job skips its finished items.",
    )
    jsub = s.add_subparsers(dest="action", required=True)
    j = jsub.add_parser("add", help="queue a job of the adapters under PATHs (local or hf://...) for `zoo worker`")
    j.add_argument("paths", nargs="+", metavar="PATH")
    j.add_argument("--base-model", metavar="NAME", help="base model name to record (overrides the files)")
    j.add_argument("--labels", metavar="CSV", help="known attributes and measurements per source, as for `zoo ingest --labels`")
    j.add_argument(
        "--metrics", type=lambda v: [c for c in v.split(",") if c], default=[], metavar="COL,...", help="further numeric CSV columns"
    )
    j.add_argument("--json", action="store_true")
    j = jsub.add_parser("list", help="the newest jobs with counts per item state and items/s")
    j.add_argument("--limit", type=int, default=50)
    j.add_argument("--json", action="store_true")
    for action, text in (
        ("show", "counts, throughput, ETA, mean seconds per stage and the slowest, failed items"),
        ("retry", "queue the failed and cancelled items again"),
        ("cancel", "cancel the queued items (running ones finish)"),
    ):
        j = jsub.add_parser(action, help=text)
        j.add_argument("id", type=int)
        j.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_jobs)

    s = sub.add_parser(
        "crawl",
        help="queue the Hub's adapters of a base model as one job (HfApi.list_models, filter base_model:adapter:ID)",
        description="Lists the Hub's adapters of a base model and queues them (hf://owner/repo) as one job for `zoo worker`.",
    )
    s.add_argument("--base-model", required=True, metavar="ID", help="the base model's Hub id, e.g. meta-llama/Llama-3.1-8B")
    s.add_argument("--search", metavar="TEXT", help="only repos whose id contains TEXT")
    s.add_argument("--author", metavar="A", help="only repos of this user or organization")
    s.add_argument("--library", metavar="NAME", help="only repos of this library, e.g. peft")
    s.add_argument("--limit", type=int, metavar="N", help="at most N repos")
    add_ray_arguments(s)
    s.add_argument("--json", action="store_true", help="print the job as a JSON object (with --ray: the run's summary)")
    s.set_defaults(func=cmd_crawl)

    s = sub.add_parser(
        "worker",
        help="process queued job items (`zoo jobs`) with N processes, embedding new adapters in batches",
        description="Claims items under a lease renewed by a heartbeat (ZOO_JOB_LEASE_S, default 60 s): a killed worker's "
        "items go back to the queue when their lease runs out. Several workers on several machines can share PostgreSQL. "
        "Newly stored adapters are embedded in batches into spaces that have embedders, so a running `zoo serve` finds them.",
    )
    s.add_argument("--concurrency", type=int, default=1, help="worker processes (default: %(default)s)")
    s.add_argument("--drain", action="store_true", help="exit once nothing is queued or being worked on (default: keep polling)")
    s.add_argument("--job", type=int, metavar="ID", help="only this job's items")
    s.add_argument("--embed-every", type=int, default=64, metavar="N", help="embed after every N new adapters (default: %(default)s)")
    s.add_argument("--device", help="torch device for canonicalization (default: cuda if available, else cpu)")
    s.add_argument("--json", action="store_true", help="no progress bar; print a JSON summary at the end")
    s.set_defaults(func=cmd_worker)

    s = sub.add_parser("serve", help="serve the web app and REST API (gunicorn)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=5000)
    s.add_argument("--workers", type=int, default=2, help="processes, each with its own query engine (default: %(default)s)")
    s.add_argument(
        "--threads", type=int, default=32, help="threads per process; a slow client holds one until its deadline (default: %(default)s)"
    )
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("token", help="API tokens for the REST API's write endpoints: create NAME | list | revoke ID")
    tsub = s.add_subparsers(dest="action", required=True)
    t = tsub.add_parser("create", help="make a token (shown once)")
    t.add_argument("name")
    t.add_argument("--json", action="store_true")
    t = tsub.add_parser("list", help="tokens, without their secrets")
    t.add_argument("--json", action="store_true")
    t = tsub.add_parser("revoke", help="revoke a token by id")
    t.add_argument("id", type=int)
    t.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_token)

    s = sub.add_parser(
        "lineage",
        help="one adapter's lineage: its base-model tree, its versions, and the adapters of the same base model, author and source",
    )
    s.add_argument("id", type=int)
    s.add_argument("--json", action="store_true", help="print a JSON object")
    s.set_defaults(func=cmd_lineage)

    s = sub.add_parser("show", help="one adapter: metadata, modules, spectra, canonical hash")
    s.add_argument("id", type=int)
    s.add_argument("--plot", metavar="PNG", help="also draw every module's singular values to this image file")
    s.add_argument("--json", action="store_true", help="print a JSON object")
    s.set_defaults(func=cmd_show)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = Settings.load(args.db, args.data_dir)
    try:
        return int(args.func(settings, args))
    except ZooError as exc:
        print(f"zoo: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # output piped into e.g. `head`
        sys.stderr.close()
        return 0
    except OperationalError as exc:
        first = str(exc.orig or exc).strip().splitlines()[0]
        where = make_url(settings.database_url).render_as_string(hide_password=True)
        if "database is locked" in first:
            print(
                f"zoo: error: the SQLite database {where} stayed locked by another writer past the busy timeout; "
                "try again, or use PostgreSQL for many concurrent writers",
                file=sys.stderr,
            )
        else:
            print(
                f"zoo: error: cannot use the database {where} ({first}); check --db / ZOO_DATABASE_URL and that the server is running",
                file=sys.stderr,
            )
        return 2


if __name__ == "__main__":
    sys.exit(main())
