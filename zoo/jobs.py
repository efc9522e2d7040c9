"""Ingestion jobs: a list of sources stored with a state per item, so progress is visible from any
process and a job survives the process that made it. `run_job` works through a job's queued items,
one transaction per item (the ingest's own) plus one per state change."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from zoo.blobs import BlobStore
from zoo.db.models import Job, JobItem
from zoo.errors import NotFoundError
from zoo.ingest import IngestOptions, Ingestor

ITEM_STATES = ("queued", "running", "done", "duplicate", "failed")


def _now() -> datetime:
    return datetime.now(timezone.utc)


def create_job(session: Session, sources: Iterable[str], options: dict[str, object], created_by: str | None = None) -> Job:
    job = Job(kind="ingest", state="queued", options=dict(options), created_by=created_by)
    job.items = [JobItem(source=s, state="queued", attempts=0) for s in sources]
    session.add(job)
    session.flush()
    return job


def run_job(sessions: sessionmaker[Session], blobs: BlobStore, job_id: int, options: IngestOptions) -> dict[str, object]:
    """Ingest the job's queued items in order; returns the job's detail when none is left."""
    ingestor = Ingestor(sessions, blobs, options)
    with sessions.begin() as session:
        session.get_one(Job, job_id).state = "running"
    while True:
        with sessions.begin() as session:
            item = session.scalars(
                select(JobItem).where(JobItem.job_id == job_id, JobItem.state == "queued").order_by(JobItem.id).limit(1)
            ).first()
            if item is None:
                break
            item.state, item.attempts, item.updated_at = "running", item.attempts + 1, _now()
            item_id, source = item.id, item.source
        result = ingestor.ingest(Path(source))
        with sessions.begin() as session:
            item = session.get_one(JobItem, item_id)
            item.state = "done" if result.status == "ingested" else result.status
            item.adapter_id, item.reason, item.updated_at = result.adapter_id, result.error, _now()
    with sessions.begin() as session:
        job = session.get_one(Job, job_id)
        job.state, job.finished_at = "done", _now()
        return job_detail(session, job)


def _counts(session: Session, job_ids: list[int]) -> dict[int, dict[str, int]]:
    rows = session.execute(
        select(JobItem.job_id, JobItem.state, func.count()).where(JobItem.job_id.in_(job_ids)).group_by(JobItem.job_id, JobItem.state)
    ).all()
    counts: dict[int, Counter[str]] = {i: Counter() for i in job_ids}
    for job_id, state, n in rows:
        counts[job_id][state] = n
    return {i: {s: c[s] for s in ITEM_STATES} | {"total": sum(c.values())} for i, c in counts.items()}


def _summary(job: Job, counts: dict[str, int]) -> dict[str, object]:
    return {
        "id": job.id,
        "kind": job.kind,
        "state": job.state,
        "created_by": job.created_by,
        "created_at": job.created_at.isoformat() if job.created_at else None,
        "finished_at": job.finished_at.isoformat() if job.finished_at else None,
        "counts": counts,
    }


def job_detail(session: Session, job: Job) -> dict[str, object]:
    """The job resource: its summary and every item."""
    items = [
        {"id": i.id, "source": i.source, "state": i.state, "reason": i.reason, "attempts": i.attempts, "adapter_id": i.adapter_id}
        for i in job.items
    ]
    return {**_summary(job, _counts(session, [job.id])[job.id]), "items": items}


def get_job(session: Session, job_id: int) -> dict[str, object]:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFoundError(f"no job with id {job_id}")
    return job_detail(session, job)


def list_jobs(session: Session, limit: int = 50) -> list[dict[str, object]]:
    """The newest jobs, with counts per item state (no items)."""
    jobs = list(session.scalars(select(Job).order_by(Job.id.desc()).limit(limit)))
    counts = _counts(session, [j.id for j in jobs])
    return [_summary(j, counts[j.id]) for j in jobs]
