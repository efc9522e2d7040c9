"""`zoo worker`: works through the queued items of ingestion jobs (zoo/store/jobs.py) with N processes.

Each process claims one item at a time under a lease that its heartbeat thread renews, ingests it and
writes the outcome. A process killed mid-item loses nothing: its lease runs out and another worker
claims the item again; a worker with nothing to claim first queues again the items of a holder on this host that
has exited, without waiting for their leases (zoo/store/jobs.py `stranded_items`; `zoo check` does the same).
The process that runs `zoo worker` (or the web app's job thread) shows the
progress and embeds what was stored in batches, finding their relations (zoo/runners/embed_stage.py, the stage `zoo
ingest` ends with too), so a running `zoo serve` finds new adapters at its next query.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import wait as wait_for
from pathlib import Path, PurePosixPath
from typing import Protocol, TypedDict

from tqdm import tqdm

from zoo import logs
from zoo.config import DEFAULT_ENERGY, DEFAULT_MAX_RANK, Settings
from zoo.metrics import metrics, note_resident
from zoo.runners.embed_stage import EMBED_EVERY, EmbedBatches
from zoo.services.ingest import IngestOptions, Ingestor, ingest_source
from zoo.sources.local import escapes
from zoo.store.blob_backends import open_blob_store
from zoo.store.blobs import BlobStore
from zoo.store.jobs import (
    PROCESSED,
    Claim,
    claim_items,
    finish_item,
    lease_seconds,
    pending_items,
    release_item,
    renew_leases,
    requeue_stranded,
    stranded_items,
)
from zoo.store.models import JobOptions
from zoo.store.session import Sessions, session_factory
from zoo.store.shared_files import local_folder, unpublish

log = logging.getLogger(__name__)


class StopFlag(Protocol):
    def is_set(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> bool: ...


@dataclass(frozen=True)
class WorkerOptions:
    job_id: int | None = None  # only this job's items
    drain: bool = False  # stop once nothing is queued or held by another worker
    lease_s: float = field(default_factory=lease_seconds)
    poll_s: float = 2.0  # how often an idle worker looks for new items
    device: str | None = None  # torch device for canonicalization


@dataclass(frozen=True)
class Outcome:
    """What became of one claimed item: done | duplicate | failed, queued (an unexpected error: tried
    again later) or lost (the lease had been taken over: the result was dropped)."""

    item_id: int
    job_id: int
    source: str
    state: str
    adapter_id: int | None = None
    reason: str | None = None
    seconds: float = 0.0


def owner_name() -> str:
    """Who holds a lease: host:pid:thread."""
    return f"{socket.gethostname()}:{os.getpid()}:{threading.current_thread().name}"


class Heartbeat:
    """A daemon thread renewing the leases this process holds, three times per lease."""

    def __init__(self, sessions: Sessions, lease_s: float) -> None:
        self.sessions, self.lease_s = sessions, lease_s
        self._held: dict[int, str] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="zoo-heartbeat", daemon=True).start()

    def hold(self, owner: str, item_id: int) -> None:
        with self._lock:
            self._held[item_id] = owner

    def drop(self, item_id: int) -> None:
        with self._lock:
            self._held.pop(item_id, None)

    def _run(self) -> None:
        while True:
            time.sleep(self.lease_s / 3)
            with self._lock:
                by_owner: dict[str, list[int]] = {}
                for item_id, owner in self._held.items():
                    by_owner.setdefault(owner, []).append(item_id)
            for owner, ids in by_owner.items():
                try:
                    renew_leases(self.sessions, owner, ids, self.lease_s)
                except Exception as exc:  # noqa: BLE001 - a database hiccup: the next beat tries again
                    log.warning("renewing leases of %s failed: %s", owner, exc)


_HEARTBEATS: dict[tuple[str, float], Heartbeat] = {}
_HEARTBEATS_LOCK = threading.Lock()


def heartbeat(database_url: str, lease_s: float) -> Heartbeat:
    """This process's heartbeat for a database and lease length (started on first use)."""
    with _HEARTBEATS_LOCK:
        key = (database_url, lease_s)
        if key not in _HEARTBEATS:
            _HEARTBEATS[key] = Heartbeat(session_factory(database_url), lease_s)
        return _HEARTBEATS[key]


def ingest_options(job_options: JobOptions, device: str | None = None) -> IngestOptions:
    """A job's stored options (base_model, base_checkpoint, energy, max_rank) as ingest options."""
    energy, max_rank, base = job_options.get("energy"), job_options.get("max_rank"), job_options.get("base_checkpoint")
    return IngestOptions(
        base_model=job_options.get("base_model"),
        base_checkpoint=Path(base) if base else None,
        energy=DEFAULT_ENERGY if energy is None else energy,
        max_rank=DEFAULT_MAX_RANK if max_rank is None else max_rank,
        device=device,
    )


def process_claim(sessions: Sessions, ingestor: Ingestor, claim: Claim, owner: str, recorded_as: str | None = None) -> Outcome:
    """Ingest a claimed item and write its outcome (if the lease is still ours); `recorded_as`: the source stored on the
    adapter, where it is not the item's (an upload's, see `upload_source`)."""
    start = time.perf_counter()
    root = claim.options.get("import_root")
    reason = escapes(Path(claim.source), Path(str(root))) if root else None  # a link swapped in since the job was made
    if reason is not None:
        held = finish_item(sessions, owner, claim.item_id, "failed", None, reason)
        return Outcome(claim.item_id, claim.job_id, claim.source, "failed" if held else "lost", None, reason, time.perf_counter() - start)
    try:
        result = ingest_source(ingestor, claim.source, claim.labels, recorded_as)
    except BaseException as exc:
        reason = f"{claim.source}: {type(exc).__name__}: {str(exc).strip()[:300]}"
        state = release_item(sessions, owner, claim.item_id, reason if isinstance(exc, Exception) else f"{reason} (interrupted)")
        if not isinstance(exc, Exception):
            raise
        return Outcome(claim.item_id, claim.job_id, claim.source, state or "lost", None, reason, time.perf_counter() - start)
    state = "done" if result.status == "ingested" else result.status
    said = (result.warnings, result.notes)  # what `zoo ingest` prints for the source besides its outcome
    held = finish_item(sessions, owner, claim.item_id, state, result.adapter_id, result.error, result.timings, *said)
    seconds = time.perf_counter() - start
    return Outcome(claim.item_id, claim.job_id, claim.source, state if held else "lost", result.adapter_id, result.error, seconds)


def upload_source(claim: Claim) -> str | None:
    """A web upload's source as the adapter records it: `upload:<hex>/<what was uploaded>` (the upload's folder and
    the names of the files sent), the same whichever node ingests it, never a path on one; None: not an upload."""
    folder = claim.options.get("upload")
    if not folder:
        return None
    return f"upload:{PurePosixPath(folder).name}/{claim.options.get('upload_name') or Path(claim.source).name}"


def local_claim(blobs: BlobStore, data_dir: Path, claim: Claim) -> tuple[Claim, Path | None]:
    """The claim with its source on this node, and the web upload's folder it reads from (None: not an upload), to
    remove once the item is finished: an upload made on another node (not under this node's data dir) is fetched
    from the bucket into this node's data dir first."""
    folder = claim.options.get("upload")
    if not folder or f"/{folder}" not in claim.source:
        return claim, None
    there, rest = claim.source.split(f"/{folder}", 1)
    if Path(claim.source).exists():  # the web app's node, or one sharing its data dir
        return claim, Path(there) / folder
    fetched = local_folder(blobs, data_dir, folder)
    rest = rest.lstrip("/")
    return replace(claim, source=str(fetched / rest) if rest else str(fetched)), fetched


def source_bytes(source: str) -> int:
    """Bytes of a local source on disk (a file, or the files of a PEFT folder); 0 for a Hub source or one gone."""
    path = Path(source)
    try:
        if path.is_dir():
            return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
        return path.stat().st_size
    except OSError:
        return 0


def count_outcome(outcome: Outcome) -> None:
    """An item's outcome in this process's metrics (zoo/metrics.py) and its log line (with the job's request id)."""
    counted = metrics()
    counted.ingest_items.labels(outcome.state).inc()
    if outcome.state in ("done", "duplicate"):
        counted.ingest_bytes.inc(source_bytes(outcome.source))
    note_resident()
    fields = {"item_id": outcome.item_id, "state": outcome.state, "adapter_id": outcome.adapter_id, "seconds": round(outcome.seconds, 3)}
    log.info("job %d item %d: %s", outcome.job_id, outcome.item_id, outcome.state, extra=fields)


def work(settings: Settings, options: WorkerOptions, stop: StopFlag) -> Iterator[Outcome | None]:
    """One worker's loop in this thread: claim, ingest, finish; yields each outcome, and None whenever
    it finds nothing to claim. With `drain`, returns once nothing is queued or held by anyone."""
    sessions = session_factory(settings.database_url)
    blobs = open_blob_store(settings)
    beat = heartbeat(settings.database_url, options.lease_s)
    owner = owner_name()
    ingestors: dict[str, Ingestor] = {}
    while not stop.is_set():
        claims = claim_items(sessions, owner, options.lease_s, 1, options.job_id)
        if not claims:
            with sessions() as session:
                stranded = stranded_items(session)
            if stranded and requeue_stranded(sessions, stranded):  # a holder gone before its lease ran out: claim now
                continue
            if options.drain:
                with sessions() as session:
                    if not pending_items(session, options.job_id):
                        return
            note_resident()  # an idle worker's memory in its metrics too
            yield None
            stop.wait(min(options.poll_s, 0.5) if options.drain else options.poll_s)
            continue
        claim = claims[0]
        key = json.dumps(claim.options, sort_keys=True, default=str)
        if key not in ingestors:
            ingestors[key] = Ingestor(sessions, blobs, ingest_options(claim.options, options.device))
        beat.hold(owner, claim.item_id)
        try:
            with logs.context(claim.options.get("request_id"), claim.job_id):  # the request that made the job, if one did
                recorded_as = upload_source(claim)
                claim, upload = local_claim(blobs, settings.data_dir, claim)
                outcome = process_claim(sessions, ingestors[key], claim, owner, recorded_as)
                count_outcome(outcome)
                if upload is not None and outcome.state in PROCESSED:  # the upload's files are done with, here and in the bucket
                    shutil.rmtree(upload, ignore_errors=True)
                    unpublish(blobs, str(claim.options.get("upload")))
        finally:
            beat.drop(claim.item_id)
        yield outcome


def _child(settings: Settings, options: WorkerOptions, out: multiprocessing.Queue, stop: StopFlag, threads: int) -> None:
    """A worker process: ingests until told to stop or its parent dies (items in hand are finished)."""
    import torch

    logs.configure()  # a spawned process starts with logging unset
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which tells us to stop
    torch.set_num_threads(threads)
    parent = multiprocessing.parent_process()
    local_stop = threading.Event()

    def watch() -> None:
        wait_for([parent.sentinel] if parent else [])
        local_stop.set()

    threading.Thread(target=watch, daemon=True).start()

    class Either:
        def is_set(self) -> bool:
            return stop.is_set() or local_stop.is_set()

        def wait(self, timeout: float | None = None) -> bool:
            local_stop.wait(timeout)
            return self.is_set()

    for outcome in work(settings, options, Either()):
        if outcome is not None:
            out.put(asdict(outcome))


def outcomes(settings: Settings, options: WorkerOptions, concurrency: int, stop: threading.Event) -> Iterator[Outcome | None]:
    """Outcomes from `concurrency` workers: this thread for one, else that many processes (ingest is
    CPU-bound torch work: processes, one torch thread each while they fill the cores). None: nothing new."""
    if concurrency == 1:
        yield from work(settings, options, stop)
        return
    ctx = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = ctx.Queue()
    child_stop = ctx.Event()
    threads = max(1, (os.cpu_count() or 1) // concurrency)
    children = [
        ctx.Process(target=_child, args=(settings, options, results, child_stop, threads), name=f"zoo-worker-{i}", daemon=True)
        for i in range(concurrency)
    ]
    for c in children:
        c.start()
    try:
        while True:
            if stop.is_set():
                child_stop.set()
            try:
                yield Outcome(**results.get(timeout=0.5))
            except queue.Empty:
                if not any(c.is_alive() for c in children):
                    break
                yield None
    finally:
        child_stop.set()
        while any(c.is_alive() for c in children):  # keep reading: a child exits once its queued outcomes are out
            with contextlib.suppress(queue.Empty):
                results.get(timeout=0.1)
        for c in children:
            c.join()
    failed = [f"{c.name} exited with {c.exitcode}" for c in children if c.exitcode]
    if failed:
        raise RuntimeError("; ".join(failed))


class WorkerSummary(TypedDict):
    """What a worker run did: its outcomes by state, the adapters it embedded per space, the jobs it worked on,
    and its rate."""

    processed: int
    done: int
    duplicate: int
    failed: int
    queued: int  # gone back to the queue (an unexpected error)
    lost: int  # taken over by another worker
    embedded: dict[str, int]
    jobs: list[int]
    concurrency: int
    seconds: float
    ingest_seconds: float
    items_per_s: float | None


class Batches(Protocol):
    """Where outcomes' adapters go to be embedded: EmbedBatches here, or an embedding actor (zoo/runners/ray.py)."""

    embedded: Counter[str]

    def add(self, outcome: Outcome) -> None: ...
    def flush(self, files: bool = True) -> None: ...


def run_worker(
    settings: Settings,
    options: WorkerOptions,
    concurrency: int = 1,
    embed_every: int = EMBED_EVERY,
    progress: bool | None = None,
    stop: threading.Event | None = None,
) -> WorkerSummary:
    """Work through queued items with `concurrency` processes until stopped (or drained), embedding new
    adapters in batches; see `drive`."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    stop = stop or threading.Event()
    batches = EmbedBatches(settings, embed_every, options.device)
    return drive(settings, options, outcomes(settings, options, concurrency, stop), batches, concurrency, progress)


def drive(
    settings: Settings,
    options: WorkerOptions,
    found: Iterator[Outcome | None],
    batches: Batches,
    concurrency: int,
    progress: bool | None = None,
) -> WorkerSummary:
    """Tally outcomes as they come, with a progress bar (None: when stderr is a terminal), hand stored
    adapters to `batches` (flushed whenever the workers find nothing new, and at the end). Returns the
    summary: outcomes by state, embedded per space, jobs, and the rate over the time the items took (as
    `zoo jobs show` measures a job's)."""
    sessions = session_factory(settings.database_url)
    tally: Counter[str] = Counter()
    jobs: set[int] = set()
    start = last_count = last_outcome = time.perf_counter()
    with sessions() as session:
        total = pending_items(session, options.job_id)
    bar = tqdm(total=total, desc="worker", unit="item", disable=None if progress is None else not progress, file=sys.stderr)
    with bar:
        for outcome in found:
            if outcome is None:
                batches.flush()
            else:
                tally[outcome.state] += 1
                last_outcome = time.perf_counter()
                jobs.add(outcome.job_id)
                batches.add(outcome)
                bar.update()
                bar.set_postfix({k: tally[k] for k in ("done", "duplicate", "failed") if tally[k]}, refresh=False)
            if not bar.disable and time.perf_counter() - last_count > 2:
                with sessions() as session:
                    bar.total = bar.n + pending_items(session, options.job_id)
                last_count = time.perf_counter()
        batches.flush()
    seconds = time.perf_counter() - start
    processed = sum(tally[s] for s in ("done", "duplicate", "failed"))
    return {
        "processed": processed,
        "done": tally["done"],
        "duplicate": tally["duplicate"],
        "failed": tally["failed"],
        "queued": tally["queued"],
        "lost": tally["lost"],
        "embedded": dict(batches.embedded),
        "jobs": sorted(jobs),
        "concurrency": concurrency,
        "seconds": round(seconds, 3),
        # as `zoo jobs show` counts a job's rate: from the first claim to the last outcome (not the embedding after it)
        "ingest_seconds": round(last_outcome - start, 3),
        "items_per_s": round(processed / (last_outcome - start), 3) if processed and last_outcome > start else None,
    }
