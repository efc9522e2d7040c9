"""Ingestion jobs: a list of sources stored with a state per item, so that progress is visible from any
process and a job survives the process that made it.

An item is queued, then running under a lease (its owner, until when), then done | duplicate | failed
(with its reason) | cancelled. Workers (zoo/runners/worker.py, the web app's job thread, later Ray tasks) share
the queue through four calls, each one short transaction given only a session factory:

- `claim_items`: queued items, or running ones whose lease expired, become running under the caller's
  lease. PostgreSQL picks them with `SELECT … FOR UPDATE SKIP LOCKED` (claimers never wait on each
  other); SQLite begins the transaction IMMEDIATE (one writer at a time).
- `renew_leases`: the heartbeat of a process pushes its items' leases forward.
- `finish_item`: the outcome, written only while the caller still holds the lease: a worker whose
  lease ran out and was taken over drops its result (the ingest is idempotent by canonical hash, so
  the item is stored once whichever worker's write counts).
- `release_item`: an attempt that broke unexpectedly goes back to the queue, failed after MAX_ATTEMPTS.

A job is done when none of its items is queued or running. Lock order on PostgreSQL: item rows, then
the job row, in every transaction.

What `zoo jobs` and the API show of a job, and retrying or cancelling one, is zoo/store/job_resources.py.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TypedDict, cast

from sqlalchemy import ColumnElement, CursorResult, and_, exists, func, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from zoo import config
from zoo.labels import LabelRow
from zoo.store.models import Adapter, Job, JobItem, JobOptions, StoredLabels
from zoo.store.session import write_transaction
from zoo.timestamps import as_utc

ITEM_STATES = ("queued", "running", "done", "duplicate", "failed", "cancelled")
#: states of an item whose source was worked on to the end
PROCESSED = ("done", "duplicate", "failed")
#: states an item leaves only through `zoo jobs retry` (failed, cancelled) or never
FINISHED = (*PROCESSED, "cancelled")
#: an item is failed once this many attempts broke off (its worker killed, or an unexpected error)
MAX_ATTEMPTS = 3


def lease_seconds() -> float:
    """How long a claim holds an item without a heartbeat (ZOO_JOB_LEASE_S, default 60)."""
    return config.JOB_LEASE_S.get()


def utc_now() -> datetime:
    return datetime.now(UTC)


def job_options(
    base_model: str | None = None, base_checkpoint: str | None = None, energy: float | None = None, max_rank: int | None = None
) -> JobOptions:
    """Job options of the values given (None: left unset)."""
    options: JobOptions = {}
    if base_model is not None:
        options["base_model"] = base_model
    if base_checkpoint is not None:
        options["base_checkpoint"] = base_checkpoint
    if energy is not None:
        options["energy"] = energy
    if max_rank is not None:
        options["max_rank"] = max_rank
    return options


@dataclass(frozen=True)
class Claim:
    """An item a worker holds: what to ingest, with the job's ingest options."""

    item_id: int
    job_id: int
    source: str
    attempt: int
    options: JobOptions
    labels: LabelRow | None = None


def create_job(
    session: Session,
    sources: Iterable[str],
    options: JobOptions,
    created_by: str | None = None,
    labels: Mapping[str, LabelRow] | None = None,
    refused: Iterable[tuple[str, str]] = (),
) -> Job:
    """A job with one queued item per source, each with its given labels if any (flushed, not committed), and
    one failed item per (source, reason) refused before it was read; a job with nothing queued is done at once."""
    job = Job(kind="ingest", state="queued", options=dict(options), created_by=created_by)
    labels = labels or {}
    job.items = [JobItem(source=s, state="queued", attempts=0, labels=_label_json(labels.get(s))) for s in sources]
    queued = bool(job.items)
    job.items += [JobItem(source=s, state="failed", attempts=0, reason=reason, updated_at=utc_now()) for s, reason in refused]
    if not queued:
        job.state, job.finished_at = "done", utc_now()
    session.add(job)
    session.flush()
    return job


def source_known(session: Session, adapter_id: int, source: str) -> bool:
    """Whether `source` is the adapter's own source or one recorded as its duplicate already: a file ingested again is
    not news about where else the adapter comes from."""
    own = session.execute(select(Adapter.id).where(Adapter.id == adapter_id, Adapter.source_uri == source)).first()
    recorded = session.execute(
        select(JobItem.id).where(JobItem.adapter_id == adapter_id, JobItem.state == "duplicate", JobItem.source == source).limit(1)
    ).first()
    return own is not None or recorded is not None


def record_duplicate(session: Session, job_id: int | None, source: str, adapter_id: int, created_by: str) -> int:
    """Record, in the caller's transaction, that an ingest run that is not a job (`zoo ingest`) found `source` to be
    the stored adapter `adapter_id`, as a job records its duplicates: an item in state duplicate, of the run's own
    finished job, made with its first duplicate (`job_id` None). Returns the job's id, for the caller to keep once its
    transaction has committed."""
    now = utc_now()
    if job_id is None:
        job = Job(kind="ingest", state="done", options={}, created_by=created_by, finished_at=now)
        session.add(job)
        session.flush()
        job_id = job.id
    session.add(JobItem(job_id=job_id, source=source, state="duplicate", attempts=1, adapter_id=adapter_id, updated_at=now))
    session.flush()
    return job_id


def _label_json(row: LabelRow | None) -> StoredLabels | None:
    return {"attributes": row.attributes, "measurements": row.measurements} if row else None


def _label_row(stored: StoredLabels | None) -> LabelRow | None:
    return LabelRow(dict(stored.get("attributes", {})), dict(stored.get("measurements", {}))) if stored else None


# --- the queue ---------------------------------------------------------------------------------------


def claim_items(sessions: sessionmaker[Session], owner: str, lease_s: float, limit: int = 1, job_id: int | None = None) -> list[Claim]:
    """Up to `limit` items (of one job, or of any job not cancelled) now held by `owner` for `lease_s`
    seconds: queued ones, or running ones whose lease expired (their worker stopped). Items that ran out
    of attempts that way are failed first, and expired items of cancelled jobs cancelled."""
    now = utc_now()
    with write_transaction(sessions) as session:
        _expire(session, now, job_id)
        live = Job.state.in_(("queued", "running"))
        claimable = or_(
            JobItem.state == "queued",
            and_(JobItem.state == "running", JobItem.lease_expires_at < now, JobItem.attempts < MAX_ATTEMPTS),
        )
        stmt = (
            select(JobItem, Job.options)
            .join(Job, Job.id == JobItem.job_id)
            .where(claimable, live, *_scope(job_id))
            .limit(limit)
            .with_for_update(skip_locked=True, of=JobItem)
        )
        rows = session.execute(stmt).all()
        claims = []
        for item, options in rows:
            item.state, item.attempts, item.lease_owner, item.reason = "running", item.attempts + 1, owner, None
            item.lease_expires_at, item.started_at, item.updated_at = now + timedelta(seconds=lease_s), now, now
            claims.append(
                Claim(item.id, item.job_id, item.source, item.attempts, options.copy() if options else {}, _label_row(item.labels))
            )
        jobs = {c.job_id for c in claims}
        if jobs:
            session.execute(update(Job).where(Job.id.in_(jobs), Job.state == "queued").values(state="running"))
        return claims


def renew_leases(sessions: sessionmaker[Session], owner: str, item_ids: Iterable[int], lease_s: float) -> set[int]:
    """Push the leases of `owner`'s items forward; returns the ids it still holds."""
    ids = list(item_ids)
    if not ids:
        return set()
    held = (JobItem.id.in_(ids), JobItem.lease_owner == owner, JobItem.state == "running")
    with write_transaction(sessions) as session:
        session.execute(update(JobItem).where(*held).values(lease_expires_at=utc_now() + timedelta(seconds=lease_s)))
        return set(session.scalars(select(JobItem.id).where(*held)))


def finish_item(
    sessions: sessionmaker[Session],
    owner: str,
    item_id: int,
    state: str,
    adapter_id: int | None = None,
    reason: str | None = None,
    timings: dict[str, float] | None = None,
    warnings: list[str] | None = None,
    notes: list[str] | None = None,
) -> bool:
    """Write an item's outcome (done | duplicate | failed), with what ingest warned of and noted, and clear its lease,
    if `owner` still holds it; False (nothing written) when another worker took it over. Settles the job."""
    if state not in PROCESSED:
        raise ValueError(f"an item finishes as one of {PROCESSED}, not {state!r}")
    values: dict[str, object] = {"state": state, "adapter_id": adapter_id, "reason": reason, "timings": timings or {}}
    values |= {"warnings": list(warnings or []), "notes": list(notes or [])}
    return _settle_item(sessions, owner, item_id, values)


def release_item(sessions: sessionmaker[Session], owner: str, item_id: int, reason: str) -> str | None:
    """An attempt broke off with an error the worker did not expect: the item goes back to the queue
    with the reason, or is failed with it after MAX_ATTEMPTS attempts. Returns the new state, or None
    when `owner` no longer held it."""
    with write_transaction(sessions) as session:
        attempts = session.scalar(select(JobItem.attempts).where(*_held(owner, item_id)))
        if attempts is None:
            return None
        if attempts >= MAX_ATTEMPTS:
            state, reason = "failed", f"{reason} (attempt {attempts} of {MAX_ATTEMPTS}: given up)"
        else:
            state = "queued"
        _settle_held(session, owner, item_id, {"state": state, "reason": reason})
        return state


def _held(owner: str, item_id: int) -> tuple[ColumnElement[bool], ...]:
    return JobItem.id == item_id, JobItem.lease_owner == owner, JobItem.state == "running"


def _settle_item(sessions: sessionmaker[Session], owner: str, item_id: int, values: Mapping[str, object]) -> bool:
    with write_transaction(sessions) as session:
        return _settle_held(session, owner, item_id, values)


def _settle_held(session: Session, owner: str, item_id: int, values: Mapping[str, object]) -> bool:
    """Write `values` and clear the lease if `owner` holds the item, then settle its job."""
    clear = {"lease_owner": None, "lease_expires_at": None, "updated_at": utc_now()}
    job_id = session.execute(update(JobItem).where(*_held(owner, item_id)).values(**values, **clear).returning(JobItem.job_id)).scalar()
    if job_id is None:
        return False
    settle_jobs(session, [job_id])
    return True


def _scope(job_id: int | None) -> tuple[ColumnElement[bool], ...]:
    return () if job_id is None else (JobItem.job_id == job_id,)


def _expire(session: Session, now: datetime, job_id: int | None) -> None:
    """Expired items out of attempts become failed; expired items of cancelled jobs cancelled."""
    expired = (JobItem.state == "running", JobItem.lease_expires_at < now, *_scope(job_id))
    cancelled_jobs = select(Job.id).where(Job.state == "cancelled")
    spent = and_(*expired, JobItem.attempts >= MAX_ATTEMPTS, JobItem.job_id.not_in(cancelled_jobs))
    dropped = and_(*expired, JobItem.job_id.in_(cancelled_jobs))
    jobs = set(session.scalars(select(JobItem.job_id).where(or_(spent, dropped)).distinct()))
    if not jobs:
        return
    clear = {"lease_owner": None, "lease_expires_at": None, "updated_at": now}
    reason = f"its worker stopped (killed, or out of memory?) in each of {MAX_ATTEMPTS} attempts: given up"
    session.execute(update(JobItem).where(spent).values(state="failed", reason=reason, **clear))
    session.execute(update(JobItem).where(dropped).values(state="cancelled", reason="cancelled; its worker stopped", **clear))
    settle_jobs(session, jobs)


def settle_jobs(session: Session, job_ids: Iterable[int]) -> None:
    """Jobs with no item queued or running are finished: done, or cancelled as they were (job rows locked,
    so that the last two items finishing at once cannot both miss it)."""
    jobs = session.scalars(select(Job).where(Job.id.in_(set(job_ids))).order_by(Job.id).with_for_update()).all()
    for job in jobs:
        pending = exists().where(JobItem.job_id == job.id, JobItem.state.in_(("queued", "running")))
        if session.scalar(select(pending)):
            continue
        if job.state != "cancelled":
            job.state = "done"
        job.finished_at = job.finished_at or utc_now()


def pending_items(session: Session, job_id: int | None = None) -> int:
    """Items queued or running (of one job, or of any)."""
    stmt = select(func.count()).select_from(JobItem).where(JobItem.state.in_(("queued", "running")), *_scope(job_id))
    return int(session.scalar(stmt) or 0)


def holder_gone(owner: str | None) -> bool:
    """Whether a lease's holder (`host:pid:thread`, zoo.runners.worker.owner_name) is a process of this host that
    no longer runs; a holder on another host is known gone only once its lease runs out."""
    host, _, rest = (owner or "").partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, someone else's
        return False
    return False


class StrandedItem(TypedDict):
    """A running item whose lease holder is gone."""

    item_id: int
    job_id: int
    source: str
    lease_owner: str | None
    why: str  # "lease expired" or "holder exited"


def stranded_items(session: Session) -> list[StrandedItem]:
    """Running items whose lease holder is gone: its lease ran out (no heartbeat renewed it), or it is a process of
    this host that has exited (noticed before the lease runs out)."""
    now = utc_now()
    rows = session.execute(
        select(JobItem.id, JobItem.job_id, JobItem.source, JobItem.lease_owner, JobItem.lease_expires_at).where(JobItem.state == "running")
    ).all()
    out: list[StrandedItem] = []
    for item_id, job_id, source, owner, expires in rows:
        until = as_utc(expires)
        expired = until is None or until < now
        if expired or holder_gone(owner):
            why = "lease expired" if expired else "holder exited"
            out.append({"item_id": item_id, "job_id": job_id, "source": source, "lease_owner": owner, "why": why})
    return out


def requeue_stranded(sessions: sessionmaker[Session], stranded: Iterable[StrandedItem]) -> int:
    """Queue stranded items again (failed once out of attempts, as a claim would), each only if the same holder
    still holds it; returns how many changed."""
    changed = 0
    with write_transaction(sessions) as session:
        now = utc_now()
        jobs = set()
        for item in stranded:
            held = (JobItem.id == item["item_id"], JobItem.state == "running", JobItem.lease_owner == item["lease_owner"])
            spent = JobItem.attempts >= MAX_ATTEMPTS
            reason = f"its worker stopped (killed, or out of memory?) in each of {MAX_ATTEMPTS} attempts: given up"
            values = {"lease_owner": None, "lease_expires_at": None, "updated_at": now}
            done = session.execute(update(JobItem).where(*held, spent).values(state="failed", reason=reason, **values))
            again = session.execute(update(JobItem).where(*held, ~spent).values(state="queued", **values))
            n = cast(CursorResult, done).rowcount + cast(CursorResult, again).rowcount
            changed += n
            if n:
                jobs.add(item["job_id"])
        settle_jobs(session, jobs)
    return changed


def pending_sources(session: Session) -> set[str]:
    """The sources of items queued or running (an upload's files belong to these until they finish)."""
    return set(session.scalars(select(JobItem.source).where(JobItem.state.in_(("queued", "running")))))


# --- commands ----------------------------------------------------------------------------------------
