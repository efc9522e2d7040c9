"""A job worked on a Ray cluster: `zoo ingest --ray [ADDRESS]` and `zoo crawl --ray [ADDRESS]`.

The pipeline is `zoo worker`'s (zoo/runners/worker.py), run as Ray tasks: one task per CPU of the cluster runs
the claim loop (claim an item under a lease, ingest it, write its outcome) until the job is drained,
streaming each outcome back to this process, which shows the progress and hands the stored adapters
to an embedding actor (embedded in batches through the query engine's incremental path, then the relation
step). The job's state stays in the database, so `zoo jobs show`, the web app's /jobs and this progress bar
read the same rows; a task whose process dies loses nothing (its lease runs out and another task claims the
item) and is replaced; a run stopped part-way is finished by `zoo worker` or another run.

Each node's data dir (`node_settings`):
- **blobs in a bucket** (ZOO_BLOB_URL): the nodes share only the database and the bucket. A task uses its own
  node's data dir for its caches (indexes, module stores, uploads and checkpoints fetched from the bucket): the
  ZOO_DATA_DIR that node's `ray start` ran with, else that node's default; on a new local instance (this
  machine), this command's data dir. Nothing is read from or written to the driver's data dir by another node.
- **blobs in the data dir** (no ZOO_BLOB_URL): every node must mount the driver's data dir at the same path. The
  driver writes a file there that each node must read back before any item is claimed; a node that cannot stops
  the run with a UsageError naming it and the directory.

With GPUs in the cluster, the embedding actor holds half of one GPU (at most one) and the ingest
tasks share the rest, so canonicalization runs on CUDA too. On a cluster of more than one node the
database must be one every node reaches (PostgreSQL), and local sources on storage every node mounts at the
same path (Hub sources and web uploads are fetched by the node that ingests them). `ZOO_*`, `HF_*` and `AWS_*`
variables (the Hub endpoint and token, the bucket's endpoint and credentials among them) are passed to the
cluster's workers, all but ZOO_DATA_DIR.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypedDict

from zoo.config import Settings, default_data_dir
from zoo.errors import UsageError
from zoo.runners.embed_stage import EMBED_EVERY, EmbedBatches
from zoo.runners.worker import Outcome, WorkerOptions, WorkerSummary, drive, work
from zoo.store.jobs import pending_items
from zoo.store.session import session_factory

log = logging.getLogger(__name__)

#: how many times in a run a task whose process died is replaced by a new one
TASK_RESTARTS = 8
#: environment variables passed to the cluster's workers (AWS_*: the credentials of the bucket blobs are kept in)
FORWARDED_PREFIXES = ("ZOO_", "HF_", "AWS_")
#: never passed on: each node has its own data dir (or must see the driver's, which the task is told)
NODE_OWN = ("ZOO_DATA_DIR",)
#: the file the driver writes in its data dir, with blobs there, for every node to read back
SEEN_FILE = ".ray-driver-"


class NodeCannotSeeDataDir(UsageError):
    """A Ray node that cannot read the driver's data dir while blobs are kept there."""


@dataclass(frozen=True)
class NodePlan:
    """How a task finds its node's data dir (module docstring): `own_dirs` with blobs in a bucket; `local_instance`
    when the cluster is a new instance on the driver's machine; with blobs in the data dir, the file `seen` in the
    driver's data dir holding `token`."""

    own_dirs: bool
    local_instance: bool
    seen: str = ""
    token: str = ""


def node_settings(settings: Settings, plan: NodePlan) -> Settings:
    """The settings a task uses on the node it runs on: its own data dir with blobs in a bucket; with blobs in the data
    dir, the driver's, once this node has read the driver's file there (NodeCannotSeeDataDir otherwise)."""
    if plan.own_dirs:
        return settings if plan.local_instance else replace(settings, data_dir=default_data_dir().resolve())
    try:
        seen = (settings.data_dir / plan.seen).read_text() == plan.token
    except OSError:
        seen = False
    if not seen:
        raise NodeCannotSeeDataDir(
            f"the Ray node {node_name()} cannot see this command's data dir {settings.data_dir}: with blobs in the data dir "
            "(no ZOO_BLOB_URL) every node must mount it at the same path; mount it there on every node, or keep blobs in a "
            "bucket (ZOO_BLOB_URL=s3://bucket/prefix), with which each node uses a data dir of its own"
        )
    return settings


def node_name() -> str:
    """This Ray node: host name and the first digits of its node id."""
    import ray

    return f"{socket.gethostname()} ({ray.get_runtime_context().get_node_id()[:8]})"


def node_data_dir(settings: Settings, plan: NodePlan) -> tuple[str, str]:
    """A task's probe of its node: (node name, the data dir tasks use there), or NodeCannotSeeDataDir."""
    return node_name(), str(node_settings(settings, plan).data_dir)


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
    env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_PREFIXES) and k not in NODE_OWN}
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


def ingest_items(settings: Settings, plan: NodePlan, options: WorkerOptions) -> Iterator[dict[str, object]]:
    """A Ray task: `zoo worker`'s claim loop on one torch thread, with its node's settings, until the job is drained,
    yielding each outcome as a dict."""
    import torch

    settings = node_settings(settings, plan)  # before any claim: a node that cannot see the data dir takes no item
    torch.set_num_threads(1)
    for outcome in work(settings, options, threading.Event()):
        if outcome is not None:
            yield asdict(outcome)


class EmbedActor:
    """A Ray actor holding the embedding batches (on a GPU when it was given one), with its node's settings."""

    def __init__(self, settings: Settings, plan: NodePlan, every: int) -> None:
        self.refused: UsageError | None = None
        try:
            settings = node_settings(settings, plan)
        except UsageError as exc:  # kept for `where`, which raises it as the caller's error
            self.refused = exc
        self.batches = EmbedBatches(settings, every)

    def where(self) -> tuple[str, str]:
        """(node name, data dir) of the actor, or the refusal its node met."""
        if self.refused is not None:
            raise self.refused
        return node_name(), str(self.batches.settings.data_dir)

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


def refusal(exc: Exception) -> UsageError | None:
    """The UsageError a Ray task or actor raised (a node that cannot see the data dir), if that is what `exc` carries."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, UsageError) else None


def probe_nodes(ray: Any, settings: Settings, plan: NodePlan) -> dict[str, str]:
    """Each alive node's data dir for the tasks ({node name: data dir}), from a task pinned to it; the first refusal
    (a node that cannot see the driver's data dir) raised here, before any item is claimed."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(node_data_dir)
    pending = [
        probe.options(num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
            settings, plan
        )
        for n in ray.nodes()
        if n.get("Alive")
    ]
    try:
        return dict(ray.get(pending))
    except ray.exceptions.RayTaskError as exc:
        raise (refusal(exc) or exc) from None


def outcomes(
    ray: Any, settings: Settings, plan: NodePlan, options: WorkerOptions, tasks: int, gpus_per_task: float
) -> Iterator[Outcome | None]:
    """Outcomes streamed from `tasks` Ray tasks; None every half second nothing came. A task that dies is
    replaced while items are left (at most TASK_RESTARTS times); one refused by its node stops the run."""
    task = ray.remote(ingest_items).options(num_cpus=1, num_gpus=gpus_per_task, max_retries=0, name="zoo-ingest")
    running = [task.remote(settings, plan, options) for _ in range(tasks)]
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
                if refused := refusal(exc):
                    raise refused from None
                with sessions() as session:
                    left = pending_items(session, options.job_id)
                if left and restarts < TASK_RESTARTS:
                    restarts += 1
                    log.warning("an ingest task died (%s); starting another (%d items left)", str(exc).splitlines()[0], left)
                    running.append(task.remote(settings, plan, options))
                elif left:
                    raise
    finally:
        for stream in running:  # stopped early: a task interrupted mid-item gives its item back
            ray.cancel(stream)


class RayCluster(TypedDict):
    cpus: int
    gpus: float
    nodes: int  # alive
    data_dirs: dict[str, str]  # each node's data dir for the tasks, by node name


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
    local_instance = not (address or os.environ.get("RAY_ADDRESS")) and not import_ray().is_initialized()
    ray = connect(settings, address)
    plan = NodePlan(own_dirs=bool(settings.blob_url), local_instance=local_instance)
    seen: Path | None = None
    if not plan.own_dirs:  # every node must read this back from the driver's data dir
        plan = replace(plan, seen=f"{SEEN_FILE}{os.getpid()}", token=secrets.token_hex(16))
        seen = settings.data_dir / plan.seen
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        seen.write_text(plan.token)
    try:
        resources = ray.cluster_resources()
        cpus, gpus = int(resources.get("CPU", 1)), float(resources.get("GPU", 0))
        tasks = tasks or max(1, cpus)
        embed_gpus, gpus_per_task = gpu_shares(gpus, tasks)
        actor = ray.remote(EmbedActor).options(num_cpus=0, num_gpus=embed_gpus, name=f"zoo-embed-{job_id}-{os.getpid()}")
        handle = actor.remote(settings, plan, embed_every)  # its process starts while the nodes are probed
        data_dirs = probe_nodes(ray, settings, plan)
        try:
            ray.get(handle.where.remote())
        except ray.exceptions.RayTaskError as exc:
            raise (refusal(exc) or exc) from None
        batches = RemoteBatches(ray, handle)
        options = WorkerOptions(job_id=job_id, drain=True, device=device)
        found = outcomes(ray, settings, plan, options, tasks, gpus_per_task)
        summary = drive(settings, options, found, batches, tasks, progress)
    finally:
        if seen is not None:
            seen.unlink(missing_ok=True)
    nodes = len([n for n in ray.nodes() if n.get("Alive")])
    return {**summary, "ray": {"cpus": cpus, "gpus": gpus, "nodes": nodes, "data_dirs": data_dirs}}
