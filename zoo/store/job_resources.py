"""The job resource: a job's summary, progress and items as `zoo jobs` and the API show them, and the two actions on a
job as a whole (retry its failed items, cancel it). The queue the workers share is zoo/store/jobs.py."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import NotRequired, TypedDict, cast

from sqlalchemy import CursorResult, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from zoo.errors import NotFoundError, UsageError
from zoo.store.jobs import ITEM_STATES, PROCESSED, settle_jobs, utc_now
from zoo.store.models import Job, JobItem
from zoo.store.rows import columns
from zoo.store.session import write_transaction
from zoo.timestamps import as_utc

#: items listed in a job's detail (its counts cover them all)
ITEMS_SHOWN = 1000
#: the stage means come from this many most recently finished items
STAGE_SAMPLE = 1000


def job_or_404(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFoundError(f"no job with id {job_id}: see `zoo jobs list`")
    return job


def retry_job(sessions: sessionmaker[Session], job_id: int) -> JobDetail:
    """Queue the job's failed and cancelled items again (with fresh attempts); its finished ones stay."""
    with write_transaction(sessions) as session:
        job = job_or_404(session, job_id)
        again = (JobItem.job_id == job_id, JobItem.state.in_(("failed", "cancelled")))
        updated = session.execute(update(JobItem).where(*again).values(state="queued", attempts=0, reason=None, updated_at=utc_now()))
        n = cast(CursorResult, updated).rowcount  # an UPDATE's result is a CursorResult (Session.execute returns a Result)
        if n:
            job.state, job.finished_at = "queued", None
        elif job.state == "cancelled":
            raise UsageError(f"job {job_id} is cancelled with no item to retry")
    with sessions() as session:
        detail = get_job(session, job_id, items=False)
    detail["requeued"] = n
    return detail


def cancel_job(sessions: sessionmaker[Session], job_id: int) -> JobDetail:
    """Cancel the job: its queued items are cancelled, its running ones finish."""
    with write_transaction(sessions) as session:
        job = job_or_404(session, job_id)
        updated = session.execute(
            update(JobItem)
            .where(JobItem.job_id == job_id, JobItem.state == "queued")
            .values(state="cancelled", reason="cancelled", updated_at=utc_now())
        )
        n = cast(CursorResult, updated).rowcount  # an UPDATE's result is a CursorResult (Session.execute returns a Result)
        if job.state in ("queued", "running"):
            job.state = "cancelled"
        settle_jobs(session, [job_id])
    with sessions() as session:
        detail = get_job(session, job_id, items=False)
    detail["cancelled_items"] = n
    return detail


def _counts(session: Session, job_ids: list[int]) -> dict[int, dict[str, int]]:
    rows = session.execute(
        select(JobItem.job_id, JobItem.state, func.count()).where(JobItem.job_id.in_(job_ids)).group_by(JobItem.job_id, JobItem.state)
    ).all()
    counts: dict[int, Counter[str]] = {i: Counter() for i in job_ids}
    for job_id, state, n in rows:
        counts[job_id][state] = n
    return {i: {s: c[s] for s in ITEM_STATES} | {"total": sum(c.values())} for i, c in counts.items()}


class _Progress(TypedDict):
    processed: int
    elapsed_s: float | None
    throughput: float | None
    eta_s: float | None


def _progress(session: Session, jobs: list[Job], counts: dict[int, dict[str, int]]) -> dict[int, _Progress]:
    """Per job: items processed, seconds since its first claim (to its last finish once nothing is
    pending), items/s over that time, and the ETA of the pending items at that rate."""
    ids = [j.id for j in jobs]
    spans = {
        job_id: (as_utc(first), as_utc(last))
        for job_id, first, last in session.execute(
            select(JobItem.job_id, func.min(JobItem.started_at), func.max(JobItem.updated_at))
            .where(JobItem.job_id.in_(ids), JobItem.started_at.is_not(None))
            .group_by(JobItem.job_id)
        )
    }
    now = utc_now()
    out: dict[int, _Progress] = {}
    for job in jobs:
        c = counts[job.id]
        processed, pending = sum(c[s] for s in PROCESSED), c["queued"] + c["running"]
        first, last = spans.get(job.id, (None, None))
        end = now if pending and job.state != "cancelled" else last
        elapsed = max((end - first).total_seconds(), 0.0) if first and end else None
        rate = processed / elapsed if elapsed and processed else None
        out[job.id] = {
            "processed": processed,
            "elapsed_s": round(elapsed, 3) if elapsed is not None else None,
            "throughput": round(rate, 3) if rate else None,
            "eta_s": round(pending / rate, 1) if rate and pending and job.state != "cancelled" else None,
        }
    return out


def stage_means(session: Session, job_id: int) -> dict[str, float]:
    """Mean seconds per ingest stage over the job's most recently finished items (STAGE_SAMPLE of them)."""
    stmt = (
        select(JobItem.timings)
        .where(JobItem.job_id == job_id, JobItem.state.in_(PROCESSED), JobItem.timings.is_not(None))
        .order_by(JobItem.updated_at.desc())
        .limit(STAGE_SAMPLE)
    )
    sums: dict[str, float] = defaultdict(float)
    n = 0
    for timings in session.scalars(stmt):
        if timings:
            n += 1
            for stage, seconds in timings.items():
                sums[stage] += float(seconds)
    return {stage: round(total / n, 6) for stage, total in sums.items()} if n else {}


class JobSummary(TypedDict):
    """A job in the list of jobs: counts per item state (and total), and progress."""

    id: int
    kind: str
    state: str
    created_by: str | None
    created_at: str | None
    finished_at: str | None
    counts: dict[str, int]
    processed: int
    elapsed_s: float | None
    throughput: float | None
    eta_s: float | None


class ItemSummary(TypedDict):
    """One item of a job."""

    id: int
    source: str
    state: str
    reason: str | None
    attempts: int
    adapter_id: int | None
    lease_owner: str | None
    started_at: str | None
    timings: dict[str, float] | None
    warnings: list[str]
    notes: list[str]


class JobDetail(JobSummary):
    """The job resource: its summary, mean seconds per stage and the slowest, its first items; what a retry
    queued again or a cancel cancelled."""

    stages: dict[str, float]
    slowest_stage: str | None
    items: NotRequired[list[ItemSummary]]
    requeued: NotRequired[int]
    cancelled_items: NotRequired[int]


#: a job's columns in its summary, in order
JOB_COLUMNS = ("id", "kind", "state", "created_by", "created_at", "finished_at")


def _summary(job: Job, counts: dict[str, int], progress: _Progress) -> JobSummary:
    return cast(JobSummary, {**columns(job, JOB_COLUMNS), "counts": counts, **progress})


#: an item's columns in its summary, in order
ITEM_COLUMNS = ("id", "source", "state", "reason", "attempts", "adapter_id", "lease_owner", "started_at", "timings")


def _item(i: JobItem) -> ItemSummary:
    return cast(ItemSummary, {**columns(i, ITEM_COLUMNS), "warnings": list(i.warnings or []), "notes": list(i.notes or [])})


def job_detail(session: Session, job: Job, items: bool = True) -> JobDetail:
    """The job resource: its summary, progress, mean seconds per stage and the slowest stage, and its
    first ITEMS_SHOWN items (the failed ones first)."""
    counts = _counts(session, [job.id])
    stages = stage_means(session, job.id)
    detail: JobDetail = {
        **_summary(job, counts[job.id], _progress(session, [job], counts)[job.id]),
        "stages": stages,
        "slowest_stage": max(stages, key=stages.__getitem__) if stages else None,
    }
    if items:
        order = (JobItem.state != "failed", JobItem.id)
        rows = session.scalars(select(JobItem).where(JobItem.job_id == job.id).order_by(*order).limit(ITEMS_SHOWN))
        detail["items"] = sorted((_item(i) for i in rows), key=lambda i: i["id"])
    return detail


def get_job(session: Session, job_id: int, items: bool = True) -> JobDetail:
    return job_detail(session, job_or_404(session, job_id), items)


def list_jobs(session: Session, limit: int = 50) -> list[JobSummary]:
    """The newest jobs, with counts per item state and progress (no items)."""
    jobs = list(session.scalars(select(Job).order_by(Job.id.desc()).limit(limit)))
    counts = _counts(session, [j.id for j in jobs])
    progress = _progress(session, jobs, counts)
    return [_summary(j, counts[j.id], progress[j.id]) for j in jobs]
