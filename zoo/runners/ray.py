"""A job worked on a Ray cluster: `zoo ingest --ray [ADDRESS]` and `zoo crawl --ray [ADDRESS]`.

The pipeline is `zoo worker`'s (zoo/runners/worker.py), run as Ray tasks: one task per CPU of the cluster runs
the claim loop (claim an item under a lease, ingest it, write its outcome) until the job is drained,
streaming each outcome back to this process, which shows the progress and hands the stored adapters
to an embedding actor (embedded in batches through the query engine's incremental path). The job's
state stays in the database, so `zoo jobs show`, the web app's /jobs and this progress bar read the
same rows; a task whose process dies loses nothing (its lease runs out and another task claims the
item) and is replaced; a run stopped part-way is finished by `zoo worker` or another run.

With GPUs in the cluster, the embedding actor holds half of one GPU (at most one) and the ingest
tasks share the rest, so canonicalization runs on CUDA too. On a cluster of more than one node the
database must be one every node reaches (PostgreSQL), and the data dir and local sources must be on
storage every node mounts at the same path. `ZOO_*` and `HF_*` variables (the Hub endpoint and token
among them) are passed to the cluster's workers.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, replace
from typing import Any, TypedDict

from zoo.config import Settings
from zoo.errors import UsageError
from zoo.runners.worker import EMBED_EVERY, EmbedBatches, Outcome, WorkerOptions, WorkerSummary, drive, work
from zoo.store.jobs import pending_items
from zoo.store.session import session_factory

log = logging.getLogger(__name__)

#: how many times in a run a task whose process died is replaced by a new one
TASK_RESTARTS = 8
#: environment variables passed to the cluster's workers
FORWARDED_PREFIXES = ("ZOO_", "HF_")


def import_ray() -> Any:
    """The `ray` module, or a usage error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray, an optional extra: pip install 'zoo[ray]'") from None
    return ray


def connect(settings: Settings, address: str | None) -> Any:
    """Join the Ray cluster at `address` (None: RAY_ADDRESS, or a new local instance on this machine's
    cores) with this machine's ZOO_*/HF_* variables; refuse a SQLite database on more than one node."""
    ray = import_ray()
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES)}
    if not ray.is_initialized():
        try:
            ray.init(
                address=address or None,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
                runtime_env={"env_vars": env} if env else None,
            )
        except ConnectionError as exc:
            hint = "" if os.environ.get("RAY_AUTH_MODE") else "; a cluster with token authentication needs RAY_AUTH_MODE=token here"
            raise UsageError(f"cannot join the Ray cluster at {address}: {str(exc).splitlines()[0]}{hint}") from None
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) > 1 and settings.database_url.startswith("sqlite"):
        raise UsageError(
            f"the Ray cluster has {len(nodes)} nodes but the database is SQLite ({settings.database_url}): "
            "give every node one PostgreSQL database (ZOO_DATABASE_URL=postgresql://...)"
        )
    return ray


def ingest_items(settings: Settings, options: WorkerOptions) -> Iterator[dict[str, object]]:
    """A Ray task: `zoo worker`'s claim loop on one torch thread until the job is drained, yielding each
    outcome as a dict."""
    import torch

    torch.set_num_threads(1)
    for outcome in work(settings, options, threading.Event()):
        if outcome is not None:
            yield asdict(outcome)


class EmbedActor:
    """A Ray actor holding the embedding batches (on a GPU when it was given one)."""

    def __init__(self, settings: Settings, every: int) -> None:
        self.batches = EmbedBatches(settings, every)

    def add(self, outcome: dict[str, Any]) -> None:
        self.batches.add(Outcome(**outcome))

    def flush(self, files: bool = True) -> dict[str, int]:
        self.batches.flush(files)
        return dict(self.batches.embedded)


class RemoteBatches:
    """The driver's handle on the embedding actor, with EmbedBatches' interface."""

    def __init__(self, ray: Any, actor: Any) -> None:
        self.ray, self.actor = ray, actor
        self.embedded: Counter[str] = Counter()

    def add(self, outcome: Outcome) -> None:
        if outcome.state in ("done", "duplicate") and outcome.adapter_id is not None:
            self.actor.add.remote(asdict(outcome))  # calls from one caller run in order

    def flush(self, files: bool = True) -> None:
        self.embedded = Counter(self.ray.get(self.actor.flush.remote(files)))


def gpu_shares(gpus: float, tasks: int) -> tuple[float, float]:
    """(GPUs for the embedding actor, GPUs per ingest task) of a cluster's `gpus`."""
    if gpus <= 0:
        return 0.0, 0.0
    embed = min(1.0, gpus / 2)
    return embed, min(1.0, (gpus - embed) / tasks)


def outcomes(ray: Any, settings: Settings, options: WorkerOptions, tasks: int, gpus_per_task: float) -> Iterator[Outcome | None]:
    """Outcomes streamed from `tasks` Ray tasks; None every half second nothing came. A task that dies is
    replaced while items are left (at most TASK_RESTARTS times)."""
    task = ray.remote(ingest_items).options(num_cpus=1, num_gpus=gpus_per_task, max_retries=0, name="zoo-ingest")
    running = [task.remote(settings, options) for _ in range(tasks)]
    sessions = session_factory(settings.database_url)
    restarts = 0
    try:
        while running:
            ready, _ = ray.wait(running, num_returns=1, timeout=0.5)
            if not ready:
                yield None
                continue
            stream = ready[0]
            try:
                yield Outcome(**ray.get(next(stream)))
            except StopIteration:
                running.remove(stream)
            except ray.exceptions.RayError as exc:  # the task's process died (or the task raised)
                running.remove(stream)
                with sessions() as session:
                    left = pending_items(session, options.job_id)
                if left and restarts < TASK_RESTARTS:
                    restarts += 1
                    log.warning("an ingest task died (%s); starting another (%d items left)", str(exc).splitlines()[0], left)
                    running.append(task.remote(settings, options))
                elif left:
                    raise
    finally:
        for stream in running:  # stopped early: a task interrupted mid-item gives its item back
            ray.cancel(stream)


class RayCluster(TypedDict):
    cpus: int
    gpus: float
    nodes: int  # alive


class RaySummary(WorkerSummary):
    """`zoo worker`'s summary of a run on Ray, with the cluster it ran on."""

    ray: RayCluster


def run_on_ray(
    settings: Settings,
    job_id: int,
    address: str | None = None,
    tasks: int | None = None,
    embed_every: int = EMBED_EVERY,
    device: str | None = None,
    progress: bool | None = None,
) -> RaySummary:
    """Work job `job_id` to the end on a Ray cluster (one task per cluster CPU unless `tasks`) with a progress
    bar; returns `zoo worker`'s summary, with the cluster's CPUs, GPUs and nodes."""
    if tasks is not None and tasks < 1:
        raise UsageError(f"--concurrency must be at least 1, got {tasks}")
    settings = replace(settings, data_dir=settings.data_dir.resolve())
    ray = connect(settings, address)
    resources = ray.cluster_resources()
    cpus, gpus = int(resources.get("CPU", 1)), float(resources.get("GPU", 0))
    tasks = tasks or max(1, cpus)
    embed_gpus, gpus_per_task = gpu_shares(gpus, tasks)
    actor = ray.remote(EmbedActor).options(num_cpus=0, num_gpus=embed_gpus, name=f"zoo-embed-{job_id}-{os.getpid()}")
    batches = RemoteBatches(ray, actor.remote(settings, embed_every))
    options = WorkerOptions(job_id=job_id, drain=True, device=device)
    found = outcomes(ray, settings, options, tasks, gpus_per_task)
    summary = drive(settings, options, found, batches, tasks, progress)
    return {**summary, "ray": {"cpus": cpus, "gpus": gpus, "nodes": len([n for n in ray.nodes() if n.get("Alive")])}}
