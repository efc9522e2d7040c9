"""`zoo jobs`, `zoo crawl`, `zoo worker`: ingestion jobs kept in the database, and the runners that work them
(in process, or on Ray with `--ray`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from zoo.cli.render import job_lines, job_list_lines, plural, print_json, worker_line
from zoo.config import Settings
from zoo.errors import UsageError
from zoo.labels import read_labels_csv
from zoo.store.models import JobOptions
from zoo.store.session import require_schema, session_factory


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


def queue_job(
    settings: Settings, paths: list[str], options: JobOptions, labels_csv: str | None, metrics: Sequence[str], created_by: str
) -> int:
    """Queue the sources under `paths` (local or `hf://`) as one job, with their labels CSV rows; its id."""
    from zoo.sources.resolve import job_sources
    from zoo.store import jobs

    label_rows = read_labels_csv(Path(labels_csv), metrics) if labels_csv else {}
    sources, labels = job_sources(paths, label_rows)
    with session_factory(settings.database_url).begin() as session:
        return jobs.create_job(session, sources, options, created_by, labels).id


def run_job_on_ray(settings: Settings, job_id: int, args: argparse.Namespace) -> int:
    """Work a queued job on Ray (zoo/runners/ray.py); print the worker's summary and the failed items."""
    from zoo.runners.ray import run_on_ray
    from zoo.store.job_resources import get_job

    device, progress = getattr(args, "device", None), False if args.json else None
    summary = run_on_ray(settings, job_id, args.ray or None, args.concurrency, device=device, progress=progress)
    with session_factory(settings.database_url)() as session:
        job = get_job(session, job_id)
    failed = [i for i in job.get("items", []) if i["state"] == "failed"]
    if args.json:
        print_json({**summary, "job": {k: v for k, v in job.items() if k != "items"}, "failures": failed})
    else:
        ray = summary["ray"]
        machines = f"{plural(ray['nodes'], 'node')}, {plural(ray['cpus'], 'CPU')}, {ray['gpus']:g} GPU{'' if ray['gpus'] == 1 else 's'}"
        print(f"job {job_id} on Ray ({machines}): " + worker_line(summary))
        for item in failed:
            print(f"  failed: {item['reason'] or item['source']}")
    return 1 if failed else 0


def cmd_jobs(settings: Settings, args: argparse.Namespace) -> int:
    from zoo.store import job_resources, jobs

    require_schema(settings.database_url)
    sessions = session_factory(settings.database_url)
    if args.action == "list":
        with sessions() as session:
            found = job_resources.list_jobs(session, args.limit)
        if args.json:
            print_json(found)
        else:
            print("\n".join(job_list_lines(found)) if found else "no jobs yet: `zoo jobs add PATH...` queues one for `zoo worker`")
        return 0
    if args.action == "add":
        job_id = queue_job(settings, args.paths, jobs.job_options(base_model=args.base_model), args.labels, args.metrics, "cli")
        with sessions() as session:
            detail = job_resources.get_job(session, job_id, items=False)
    elif args.action == "retry":
        detail = job_resources.retry_job(sessions, args.id)
    elif args.action == "cancel":
        detail = job_resources.cancel_job(sessions, args.id)
    else:
        with sessions() as session:
            detail = job_resources.get_job(session, args.id)
    if args.json:
        print_json(detail)
    else:
        print("\n".join(job_lines(detail)))
    return 0


def cmd_crawl(settings: Settings, args: argparse.Namespace) -> int:
    from zoo.sources.hub import crawl
    from zoo.store import job_resources, jobs

    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit must be at least 1")
    require_schema(settings.database_url)
    sources = crawl(args.base_model, search=args.search, author=args.author, library=args.library, limit=args.limit)
    with session_factory(settings.database_url).begin() as session:
        job = jobs.create_job(session, sources, {}, "crawl")
        detail = job_resources.job_detail(session, job, items=False)
    if args.ray is not None:
        return run_job_on_ray(settings, detail["id"], args)
    if args.json:
        print_json({**detail, "sources": sources})
    else:
        print(f"job {detail['id']}: {plural(len(sources), 'adapter')} of {args.base_model} queued; run `zoo worker --drain`")
    return 0


def cmd_worker(settings: Settings, args: argparse.Namespace) -> int:
    import signal
    import threading

    from zoo import logs, metrics
    from zoo.runners.worker import WorkerOptions, run_worker
    from zoo.store.job_resources import get_job

    require_schema(settings.database_url)
    if args.concurrency < 1 or args.embed_every < 1:
        raise UsageError("--concurrency and --embed-every must be at least 1")
    logs.configure()
    if args.metrics_port is not None:  # this process's and its workers' counts, on their own port (zoo/metrics.py)
        metrics.use_multiprocess_dir("worker")
        metrics.serve_metrics(args.metrics_port, args.metrics_host)
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
        print_json(summary)
        return 0
    print(worker_line(summary))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    """This module's commands on the `zoo` parser."""
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
    s.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics (items, bytes and adapters embedded, memory) on http://HOST:PORT/metrics (default: none)",
    )
    s.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST", help="the address of --metrics-port (default: %(default)s)")
    s.set_defaults(func=cmd_worker)
