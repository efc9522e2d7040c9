"""`zoo ingest`, `zoo list`, `zoo show`, `zoo lineage`, `zoo export`, `zoo check`: adapters as stored."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from tqdm import tqdm

from zoo.cli.jobs import add_ray_arguments, queue_job, run_job_on_ray
from zoo.cli.render import human, label_columns, lineage_lines, plural, print_json, relations_line, table
from zoo.cli.spaces import blob_store, query_engine
from zoo.config import DEFAULT_ENERGY, DEFAULT_MAX_RANK, Settings
from zoo.errors import NotFoundError, UsageError
from zoo.labels import LabelRow, assign_rows, read_labels_csv
from zoo.limits import DEFAULT_PER_PAGE, MAX_PER_PAGE
from zoo.store import repository
from zoo.store.blob_backends import open_blob_store
from zoo.store.catalog import SORTS, search_catalog
from zoo.store.session import require_schema, session_factory

if TYPE_CHECKING:
    from zoo.runners.embed_stage import EmbedBatches
    from zoo.services.ingest import IngestOptions, IngestResult


def run_ingest(
    settings: Settings,
    paths: list[str],
    options: IngestOptions,
    label_rows: dict[str, LabelRow],
    as_json: bool,
    progress: bool = True,
    batches: EmbedBatches | None = None,
) -> tuple[dict[str, int], list[str]]:
    """Ingest every source under paths (and `hf://` sources), printing JSON lines or showing a progress bar, handing
    each adapter stored (or found stored) to `batches`, the embed stage. Returns counts by status and failures."""
    from zoo.services.ingest import Ingestor, ingest_sources
    from zoo.sources import hub
    from zoo.sources.local import expand_paths
    from zoo.sources.resolve import is_remote

    remote = [p for p in paths if is_remote(p)]
    for source in remote:
        hub.parse(source)  # a malformed source is a usage error before anything runs
    require_schema(settings.database_url)
    ingestor = Ingestor(session_factory(settings.database_url), open_blob_store(settings), options, record_duplicates_as="zoo ingest")
    counts = {"ingested": 0, "duplicate": 0, "failed": 0}
    failures: list[str] = []
    sources = expand_paths([p for p in paths if not is_remote(p)])
    labels = assign_rows(label_rows, sources) if label_rows else {}
    queue = [(str(p), labels.get(p)) for p, _ in sources] + [(s, None) for s in remote]
    results = ingest_sources(ingestor, queue)  # `zoo worker`'s per-source step, the next source worked on while one is stored
    total = len(sources) + len(remote)
    with tqdm(total=total, desc="ingest", unit="adapter", disable=True if as_json or not progress else None, file=sys.stderr) as bar:
        for result in results:
            bar.update()
            counts[result.status] += 1
            if batches is not None and result.status != "failed" and result.adapter_id is not None:
                batches.stored(result.adapter_id)
            for warning in result.warnings:
                bar.write(f"warning: {warning}", file=sys.stderr)
            if as_json:
                print_json(result.as_dict())
            elif result.status == "failed":
                failures.append(result.error or result.source)
            elif result.revision or result.status == "duplicate" or result.head:
                bar.write(result_line(result), file=sys.stdout)
            bar.set_postfix(counts)
    return counts, failures


def result_line(result: IngestResult) -> str:
    """One source's outcome worth a line of its own: a duplicate names the stored adapter it is; a Hub source its
    revision; a PEFT head stored with the adapter its tensors."""
    at = f" at revision {result.revision}" if result.revision else ""
    if result.status == "duplicate":
        return f"{result.source}{at}: duplicate of #{result.adapter_id} {result.duplicate_of or ''}".rstrip()
    head = result.head
    stored = f", with its head ({head_text(head['tensors'])}; {head['bytes']:,} bytes)" if head else ""
    return f"{result.source}{at}: {result.status}, adapter {result.adapter_id}{stored}"


def head_text(tensors: list[str]) -> str:
    """A stored PEFT head's tensors in words."""
    return f"{plural(len(tensors), 'tensor')}: " + ", ".join(tensors[:4]) + (", ..." if len(tensors) > 4 else "")


def cmd_ingest(settings: Settings, args: argparse.Namespace) -> int:
    from zoo.services.ingest import IngestOptions
    from zoo.store import jobs

    if args.ray is not None:
        if args.no_embed:
            raise UsageError("--no-embed: a job worked on Ray embeds what it stores; `zoo jobs add` queues one for `zoo worker`")
        require_schema(settings.database_url)
        base = str(Path(args.base).absolute()) if args.base else None
        job_options = jobs.job_options(base_model=args.base_model, base_checkpoint=base, energy=args.energy, max_rank=args.max_rank)
        return run_job_on_ray(settings, queue_job(settings, args.paths, job_options, args.labels, args.metrics, "ingest --ray"), args)
    options = IngestOptions(
        base_model=args.base_model,
        base_checkpoint=Path(args.base) if args.base else None,
        energy=args.energy,
        max_rank=args.max_rank,
        device=args.device,
    )
    label_rows = read_labels_csv(Path(args.labels), args.metrics) if args.labels else {}
    batches = None
    if not args.no_embed:
        from zoo.runners.embed_stage import EmbedBatches

        # every=None: embedded once all are stored, so a new space's embedders take the vocabulary of all of them
        batches = EmbedBatches(settings, None, args.device, progress=False if args.json else None, new_spaces=True)
    counts, failures = run_ingest(settings, args.paths, options, label_rows, args.json, batches=batches)
    if not args.json:
        print(f"{counts['ingested']} ingested, {plural(counts['duplicate'], 'duplicate')}, {counts['failed']} failed")
        for f in failures:
            print(f"  failed: {f}")
    failed = 1 if counts["failed"] else 0
    return failed if batches is None else embed_stage(batches, sys.stderr if args.json else sys.stdout) or failed


def embed_stage(batches: EmbedBatches, out: TextIO) -> int:
    """Embed what the run stored and find its relations, as a job's worker does (zoo/runners/embed_stage.py); say what
    it did on `out` (stderr under --json: stdout holds the sources' lines alone). A failure keeps what was stored: it
    says so, and that `zoo embed` finishes the work; 1 then, else 0."""
    try:
        batches.flush()
    except Exception as exc:  # noqa: BLE001 - whatever broke, the adapters are stored and `zoo embed` picks them up
        print(
            f"zoo: error: the adapters are stored, but embedding them failed ({type(exc).__name__}: {str(exc).strip()[:300]}); "
            "`zoo embed` embeds them and finds their relations",
            file=sys.stderr,
        )
        return 1
    finally:
        batches.close()
    if batches.embedded:
        print("embedded: " + ", ".join(f"{plural(n, 'adapter')} in {space}" for space, n in sorted(batches.embedded.items())), file=out)
    for report in batches.relations.values():
        print(relations_line(report), file=out)
    return 0


#: what `zoo list --filter` and `zoo search --filter` take (zoo.store.filters)
FILTER_HELP = (
    "base_model, format, rank, source (prefix), author, license, pipeline_tag, library, base_model_relation, relation, "
    "derived_from, or a label; label.KEY=VALUE is always the label (label.rank=8); repeatable"
)


def cmd_list(settings: Settings, args: argparse.Namespace) -> int:
    require_schema(settings.database_url)
    filters = repository.parse_filters(args.filter)
    if args.base_model:
        filters.setdefault("base_model", args.base_model)
    sessions = session_factory(settings.database_url)
    with sessions() as session:
        if args.semantic:
            from embed.serving.text_search import search_by_meaning

            found = search_by_meaning(session, query_engine(settings, None), args.query, filters, args.sort, args.page, args.per_page)
        else:
            found = search_catalog(session, args.query, filters, args.sort, args.page, args.per_page)
    if args.json:
        print_json(found)
        return 0
    total, rows = found["total"], found["results"]
    if not rows:
        if total:
            print(f"page {args.page} is past the last page of {plural(total, 'adapter')}")
        else:
            print("no adapters match" if args.query or filters else "no adapters yet: add some with `zoo ingest PATH`")
        return 0
    print("\n".join(list_lines(rows)))
    if found.get("semantic"):
        print("why:\n" + "\n".join(f"  {r['id']}: {', '.join(r.get('why', []))}" for r in rows))
    pages = -(-total // args.per_page)
    if pages > 1:
        print(f"page {args.page} of {pages} ({plural(total, 'adapter')}, sorted by {found['sort']}): --page N for another")
    return 0


def list_lines(rows: list) -> list[str]:
    """A page of the catalog as a table: id, name, format, rank, base model, given labels (the task first), hash."""
    header, labels = label_columns([r["labels"] for r in rows])
    cells = [
        [r["id"], str(r["name"])[:32], r["format"], r["rank"] or "-", str(r["base_model"])[:28], *more, str(r["canonical_hash"])[:12]]
        for r, more in zip(rows, labels, strict=True)
    ]
    right = [True, False, False, True, False, *[False] * len(header), False]
    return table(["id", "name", "format", "rank", "base model", *header, "hash"], cells, right)


def cmd_show(settings: Settings, args: argparse.Namespace) -> int:
    require_schema(settings.database_url)
    with session_factory(settings.database_url)() as session:
        adapter = repository.get_adapter(session, args.id, with_modules=True)
        if adapter is None:
            raise NotFoundError(f"no adapter with id {args.id}: see `zoo list`")
        detail = repository.adapter_detail(adapter)
        duplicates = repository.duplicate_sources(session, args.id)
    if args.plot:
        from zoo.plots import plot_spectra

        plot_spectra(detail["name"], detail["modules"], Path(args.plot))
    if args.json:
        print_json({**detail, "duplicate_sources": duplicates})
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
    if detail["head_blob"]:
        print(f"{'head':>15}: {head_text(sorted(detail['extra_tensors']))} (stored for exports, blob {detail['head_blob'][:12]})")
    for note in detail["notes"]:
        print(f"{'note':>15}: {note}")
    for source in duplicates:
        print(f"{'also ingested':>15}: {source}  (a duplicate of this adapter)")
    for key, value in detail["labels"].items():
        print(f"{key:>15}: {value}  (label)")
    for metric, measured in detail["measurements"].items():
        print(f"{metric:>15}: {measured:.4g}  (measured)")
    print()
    print(f"{'module':<48} {'shape':>12} {'r':>3} {'k':>3} {'σ_max':>9} {'‖·‖_F':>9} {'stable':>7} {'eff':>6} {'α_PL':>6}")
    for m in detail["modules"]:
        shape = "x".join(map(str, m["shape"]))
        alpha = f"{m['power_law_alpha']:.2f}" if m["power_law_alpha"] is not None else "-"
        print(
            f"{m['name'][-48:]:<48} {shape:>12} {m['rank'] or '-':>3} {m['canonical_rank'] or '-':>3} "
            f"{m['spectral_norm']:>9.3g} {m['frobenius_norm']:>9.3g} {m['stable_rank']:>7.2f} "
            f"{m['effective_rank']:>6.2f} {alpha:>6}"
        )
    return 0


def cmd_lineage(settings: Settings, args: argparse.Namespace) -> int:
    from zoo.store.lineage import lineage

    require_schema(settings.database_url)
    with session_factory(settings.database_url)() as session:
        found = lineage(session, args.id)
    if args.json:
        print_json(found)
    else:
        print("\n".join(lineage_lines(found)))
    return 0


def cmd_export(settings: Settings, args: argparse.Namespace) -> int:
    from zoo.services.export import export_files, export_notes, export_zip, load_for_export

    require_schema(settings.database_url)
    with session_factory(settings.database_url)() as session:
        factors, meta = load_for_export(session, blob_store(settings), args.id)
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
        "notes": export_notes(meta, args.format),
    }
    if args.json:
        print_json(info)
        return 0
    print(f"adapter {meta.adapter_id} ({meta.name}) exported as {args.format}: {', '.join(info['files'])}")
    for note in info["notes"]:
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


def cmd_check(settings: Settings, args: argparse.Namespace) -> int:
    from zoo.services.check import check

    require_schema(settings.database_url)
    report = check(settings, repair=args.repair, grace_s=args.grace)
    if args.json:
        print_json(report)
    else:
        b = report["blobs"]
        print(
            f"{plural(b['rows'], 'adapter')} with blobs: {len(b['missing'])} missing, {len(b['corrupt'])} corrupt; "
            f"{plural(len(report['orphans']), 'orphan blob')}, {plural(len(report['temporary_files']), 'temporary file')} "
            f"({report['in_flight']} younger than {args.grace:g} s left alone), {report['removed']} removed"
        )
        for entry in report["indexes"]:
            if entry["state"] != "ok":
                what = "map" if "map" in entry else f"{entry['method']} index" if "method" in entry else "module store"
                done = " (rebuilt)" if entry.get("repaired") else ""
                print(f"  {entry['space']}: {what}: {entry['state']}{done}")
        for gap in report["unembedded"]:
            print(f"  {gap['space']}: {plural(gap['count'], 'adapter')} not embedded" + (" (embedded now)" if gap.get("repaired") else ""))
        for m in report["misfits"]:
            have, want = "×".join(map(str, m["shape"])), "×".join(map(str, m["space_shape"]))
            print(
                f"  {m['space']}: adapter {m['adapter_id']} {m['name']} does not fit: {m['module']} is {have}, {want} in the space"
                " (ingest it under its own base model)"
            )
        text = report["text_index"]
        if text["state"] not in ("ok", "not built") and "repaired" not in text:
            print(f"  text index {text['path']}: {text['state']}")
        for line in report["repaired"]:
            print(f"  repaired: {line}")
        for folder in report["uploads"]["orphans"]:
            print(f"  orphaned upload {folder}" + (" (removed)" if args.repair else ""))
        for up in report["bucket_uploads"]["orphans"]:
            whole = "" if up["complete"] else ", never put up whole"
            print(f"  orphaned upload {up['where']}: {plural(up['files'], 'file')}{whole}, last written {up['age_s']:.0f} s ago"
                  + (" (removed)" if args.repair else ""))  # fmt: skip
        for item in report["jobs"]["stranded"]:
            again = " (queued again)" if args.repair else ""
            print(f"  job {item['job_id']} item {item['item_id']}: {item['why']}, held by {item['lease_owner']}{again}")
        lost = [*b["missing"], *b["corrupt"]]
        for x in lost:
            print(f"  adapter {x['adapter_id']}: blob {x['blob']} is missing or corrupt: ingest it again")
        print("ok" if report["ok"] else plural(report["problems"], "problem") + ("" if args.repair else ": run `zoo check --repair`"))
    return 0 if report["ok"] else 1


def add_commands(sub: argparse._SubParsersAction) -> None:
    """This module's commands on the `zoo` parser."""
    s = sub.add_parser(
        "ingest",
        help="read, canonicalize, describe and store adapters",
        description="Ingest PEFT adapter directories, kohya/diffusers LoRA .safetensors files and full "
        "checkpoints. A directory of adapters is searched recursively. Every source is tried; then what was stored is "
        "embedded and its relations found, as a job's worker does (--no-embed: not). "
        "The exit status is 1 if any source failed, or if the embedding did (the adapters stay stored: run `zoo embed`).",
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
    s.add_argument(
        "--no-embed",
        action="store_true",
        help="only store: leave embedding and the relation step to `zoo embed` (by default they follow, as in a job)",
    )
    add_ray_arguments(s)
    s.add_argument("--json", action="store_true", help="one JSON object per source, no progress bar (with --ray: one summary)")
    s.set_defaults(func=cmd_ingest)

    s = sub.add_parser(
        "list",
        help="list and search stored adapters: free text, filters, sorts, pages",
        description="Searches names, base model, labels (keys and values), tags, model cards and source URIs: "
        "words are AND-ed, punctuated words are phrases (task=even, digits-vit-00012), the last word is a prefix.",
    )
    s.add_argument("--query", "-q", metavar="TEXT", help="free text")
    s.add_argument(
        "--semantic",
        action="store_true",
        help="rank by meaning: the query's sentence against the adapters' text and predicted attributes, fused with full text, "
        "plus weight-space neighbours of the text hits (needs the `text` extra); each result says why it matched",
    )
    s.add_argument("--filter", action="append", default=[], metavar="KEY=VALUE", help=FILTER_HELP)
    s.add_argument("--base-model", metavar="NAME", help="same as --filter base_model=NAME")
    s.add_argument("--sort", choices=SORTS, help="default: relevance with --query, else newest")
    s.add_argument("--page", type=int, default=1)
    s.add_argument("--per-page", type=int, default=DEFAULT_PER_PAGE, help=f"at most {MAX_PER_PAGE} (default %(default)s)")
    s.add_argument("--json", action="store_true", help="print the whole result: page, total and facets")
    s.set_defaults(func=cmd_list)

    s = sub.add_parser("show", help="one adapter: metadata, modules, spectra, canonical hash")
    s.add_argument("id", type=int)
    s.add_argument("--plot", metavar="PNG", help="also draw every module's singular values to this image file")
    s.add_argument("--json", action="store_true", help="print a JSON object")
    s.set_defaults(func=cmd_show)

    s = sub.add_parser(
        "lineage",
        help="one adapter's lineage: its base-model tree, its versions, and the adapters of the same base model, author and source",
    )
    s.add_argument("id", type=int)
    s.add_argument("--json", action="store_true", help="print a JSON object")
    s.set_defaults(func=cmd_lineage)

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
        "check",
        help="verify blobs against rows, find orphans and temporary files, check indexes and embeddings (exit 1 if anything is wrong)",
    )
    s.add_argument("--repair", action="store_true", help="remove orphans and temporary files, rebuild indexes, embed what is missing")
    s.add_argument(
        "--grace", type=float, default=3600.0, metavar="SECONDS", help="leave files younger than this alone (default: %(default)s)"
    )
    s.add_argument("--json", action="store_true", help="print a JSON object")
    s.set_defaults(func=cmd_check)
