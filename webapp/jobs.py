"""Ingestion jobs started from the web app: checked paths or saved uploads, worked on in the app's job thread
(the same claims, leases and drive loop as `zoo worker`, which may take a share of the items too)."""

from __future__ import annotations

import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from webapp.context import db, zoo_context
from zoo import logs, memory
from zoo.errors import UsageError
from zoo.runners.embed_stage import EMBED_EVERY, EmbedBatches
from zoo.runners.worker import Outcome, WorkerOptions, drive, work
from zoo.sources.local import expand_under
from zoo.sources.upload import Upload, materialize
from zoo.store.job_resources import JobDetail, job_detail
from zoo.store.jobs import PROCESSED, create_job
from zoo.store.models import JobOptions
from zoo.store.shared_files import in_bucket, publish, unpublish

#: characters of the uploaded files' names kept in the job, for the adapter's recorded source
MAX_UPLOAD_NAME = 300


def import_path(raw: str) -> Path:
    """The path, resolved (symlinks included), if it lies under the import root; UsageError otherwise."""
    root = zoo_context().web.import_root
    if root is None:
        raise UsageError("ingest by path is off: set ZOO_IMPORT_ROOT to the directory paths may name, or upload files")
    path = (root / raw).resolve() if not Path(raw).is_absolute() else Path(raw).resolve()
    if not path.is_relative_to(root):
        raise UsageError(f"{raw}: outside the import root {root}")
    try:
        path.exists()  # a name the OS refuses (too long) is the caller's error; a missing path fails as the job's item
    except OSError as exc:
        raise UsageError(f"{raw[:200]}: {exc.strerror}") from None
    return path


def start_ingest(paths: list[str], files: list, base_model: str | None, created_by: str) -> JobDetail:
    """Create a job for the paths (or the upload, saved under the data dir, and in the bucket where blobs are kept, until
    its item is finished) and start it: the job thread works on its items until none is queued or held by a worker,
    embedding what it stored. A job the app leaves unfinished (the app stopped) is finished by `zoo worker`."""
    ctx = zoo_context()
    if bool(paths) == bool(files):
        raise UsageError("send either `paths` (under the import root) or files in the `file` field")
    upload_dir = None
    refused: list[tuple[str, str]] = []
    options: JobOptions = {"base_model": base_model}
    if request_id := logs.REQUEST_ID.get():
        options["request_id"] = request_id  # the items' log lines carry it, in any worker (zoo/logs.py)
    if files:
        folder = f"uploads/{uuid.uuid4().hex}"
        upload_dir = ctx.settings.data_dir / folder
        upload_dir.mkdir(parents=True)
        try:
            sources = [str(materialize([Upload(f.filename or "upload", f.stream) for f in files], upload_dir, ctx.web.max_upload_bytes))]
            publish(ctx.blobs, ctx.settings.data_dir, folder)  # in the bucket before the job commits: any worker may claim it
        except Exception:
            shutil.rmtree(upload_dir, ignore_errors=True)
            unpublish(ctx.blobs, folder)
            raise
        options["upload"] = folder
        given = sorted(PurePosixPath((f.filename or "upload").replace("\\", "/")).name for f in files)
        options["upload_name"] = "+".join(given)[:MAX_UPLOAD_NAME]  # the adapter's recorded source: upload:<hex>/<this>
    else:
        named = [import_path(p) for p in paths]
        root = ctx.web.import_root
        assert root is not None  # import_path refuses every path without one
        found, left_out = expand_under(root, named)  # nothing resolving outside the root is walked
        sources = [str(source) for source, _ in found]
        refused = [(str(path), reason) for path, reason in left_out]
        options["import_root"] = str(root)  # the worker checks each item again when it reads it
    session = db()
    job = create_job(session, sources, options, created_by, refused=refused)
    session.commit()
    detail = job_detail(session, job)

    if not ctx.web.run_jobs:  # left to `zoo worker`s: with a bucket, any node's fetches the upload from there
        if upload_dir is not None and in_bucket(ctx.blobs):
            shutil.rmtree(upload_dir, ignore_errors=True)
        return detail
    worker_options = WorkerOptions(job_id=job.id, drain=True)

    def remove_upload() -> None:
        if upload_dir is not None:
            shutil.rmtree(upload_dir, ignore_errors=True)
            unpublish(ctx.blobs, options["upload"])

    def outcomes() -> Iterator[Outcome | None]:
        try:
            for outcome in work(ctx.settings, worker_options, threading.Event()):
                if outcome is not None and outcome.state in PROCESSED:  # an upload is one item: its files are done with
                    remove_upload()
                yield outcome
        finally:
            remove_upload()

    def run() -> None:
        try:
            drive(ctx.settings, worker_options, outcomes(), EmbedBatches(ctx.settings, EMBED_EVERY), 1, progress=False)
        finally:
            memory.trim()  # what reading and sketching the adapters freed goes back to the system (zoo/memory.py)

    ctx.jobs.submit(run)
    return detail
