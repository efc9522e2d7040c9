"""`zoo make-zoo`: build a reference zoo, deterministic from a seed, resumable, parallel."""

from __future__ import annotations

import csv
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NotRequired, TypedDict, cast

import numpy as np
import torch
from tqdm import tqdm

from zoo.errors import UsageError, ZooError
from zoo.reference import lineage
from zoo.reference.lineage import LineageAttributes, Mix
from zoo.reference.recipes import Recipe, get_recipe
from zoo.reference.training import AdapterAttributes

ATTRIBUTES_FILE = "zoo_attributes.json"
LABELS_FILE = "labels.csv"
#: Per-adapter bookkeeping kept in ATTRIBUTES_FILE but not written to labels.csv.
NOT_LABELS = ("recipe", "base_model", "train_seconds", "cpu_kernels")
#: Columns test accuracy is not broken down by (besides NOT_LABELS): one value or nearly one per adapter.
NOT_GROUPED = ("name", "seed", "learning_rate", "test_accuracy", "parents", "weights", "scale", "sparsity")
#: Training amplifies float rounding, so a seed gives the same bytes on two machines only if torch's
#: own kernels (ATen), MKL's and oneDNN's take the same code paths on both. On x86-64 every build
#: worker is held to AVX2, which AVX-512 CPUs have too; elsewhere nothing is pinned.
PINNED_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


#: One adapter's generating attributes: its recipe's, or a lineage zoo member's.
Attributes = AdapterAttributes | LineageAttributes


class ManifestRow(AdapterAttributes):
    """One adapter as built (its ATTRIBUTES_FILE): the generating attributes, its test accuracy, bookkeeping (a
    lineage zoo member's also has LineageAttributes' keys, and None where its recipe's have none)."""

    name: str
    recipe: str
    base_model: str
    test_accuracy: float
    train_seconds: float
    cpu_kernels: str


class Spread(TypedDict):
    """Test accuracy over a group of adapters; over a task's, with what it is to be read against."""

    mean: float
    min: float
    max: float
    n: int
    chance: NotRequired[float]  # a task's
    base: NotRequired[float | None]  # a task's: the base model's own (None: it has no head for the task)


class OverallSpread(Spread):
    std: float


class AccuracySpread(TypedDict, total=False):
    """Test accuracy overall and by value of each attribute (nothing without adapters)."""

    overall: OverallSpread
    by: dict[str, dict[str, Spread]]


class ZooReport(TypedDict):
    """What `make_zoo` built."""

    out_dir: str
    recipe: str
    base_model: str
    count: int
    seed: int
    built: int
    skipped: int
    seconds: float
    train_seconds_per_adapter: float | None
    cpu_kernels: str | None
    disk_bytes: int
    labels: str
    accuracy: AccuracySpread


def adapter_name(recipe: str, index: int) -> str:
    return f"{recipe}-{index:05d}"


def planned_attributes(recipe: str, seed: int, index: int) -> AdapterAttributes:
    """Adapter `index`'s generating attributes: a function of (recipe, seed, index) only."""
    return get_recipe(recipe).sample_attributes(np.random.default_rng([seed, index]))


def plan_zoo(recipe: str, seed: int, count: int, mix: Mix | None = None) -> dict[str, Attributes]:
    """Every adapter's name and generating attributes; the first n do not depend on count (a lineage recipe's
    member depends on the members before it)."""
    r = get_recipe(recipe)
    if r.lineage_of is None:
        if mix is not None:
            raise UsageError(f"--mix is for lineage recipes; {recipe} is not one")
        return {adapter_name(recipe, i): planned_attributes(recipe, seed, i) for i in range(count)}
    members = lineage.plan_lineage(r, seed, count, mix or Mix(), lambda i: adapter_name(recipe, i))
    return {adapter_name(recipe, i): m for i, m in enumerate(members)}


_CONTEXT: dict[tuple[str, str], Any] = {}


def _context(recipe: str, cache_dir: Path) -> Any:
    key = (recipe, str(cache_dir))
    if key not in _CONTEXT:
        _CONTEXT[key] = get_recipe(recipe).prepare(cache_dir)
    return _CONTEXT[key]


#: the base model's accuracy per (recipe, cache dir, task): a function of the cached base and the task's fixed split,
#: worked out once a process (a resumed or repeated build, and each task of a merge, asks again)
_BASE_ACCURACY: dict[tuple[str, str, str], float | None] = {}


def _base_accuracy(r: Recipe, cache_dir: Path, task: str) -> float | None:
    key = (r.name, str(cache_dir), task)
    if key not in _BASE_ACCURACY:
        _BASE_ACCURACY[key] = r.base_accuracy(_context(r.name, cache_dir), task)
    return _BASE_ACCURACY[key]


def build_one(recipe: str, cache_dir: Path, out_dir: Path, name: str, attrs: Attributes) -> ManifestRow:
    """Train one adapter (or make a lineage member from its parents in out_dir) and save it (PEFT's
    save_pretrained) to out_dir/name, atomically."""
    r = get_recipe(recipe)
    t0 = time.perf_counter()
    ctx = _context(recipe, cache_dir)
    if attrs.get("relation", "root") == "root":
        model, acc = r.train(ctx, cast(AdapterAttributes, attrs))
    else:
        model, acc = lineage.make_child(r, ctx, out_dir, cast(LineageAttributes, attrs))
    row = cast(
        ManifestRow,  # a lineage member's attributes: see ManifestRow
        {
            "name": name,
            "recipe": recipe,
            "base_model": r.base_model,
            **attrs,
            "test_accuracy": round(acc, 6),
            "train_seconds": round(time.perf_counter() - t0, 3),
            "cpu_kernels": torch.backends.cpu.get_cpu_capability(),
        },
    )
    tmp = out_dir / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), save_embedding_layers=False)  # "auto" would look the base up on the Hub
    (tmp / ATTRIBUTES_FILE).write_text(json.dumps(row, indent=1))
    final = out_dir / name
    if final.exists():  # a stale, unfinished directory from an interrupted run
        shutil.rmtree(final)
    os.replace(tmp, final)
    return row


def _init_worker() -> None:
    torch.set_num_threads(1)


def _prepare(recipe: str, cache_dir: Path) -> None:
    """_context in a worker, returning nothing (the context itself is not sent back)."""
    _context(recipe, cache_dir)


def kernel_pins() -> dict[str, str]:
    """The kernel settings build workers start with on this machine: PINNED_KERNELS on x86-64, else none."""
    return PINNED_KERNELS if platform.machine().lower() in ("x86_64", "amd64") else {}


@contextmanager
def _pinned_kernels() -> Iterator[None]:
    """kernel_pins() in the environment while the block starts worker processes (which read it at
    start-up, before their first kernel runs); the caller's environment is restored after."""
    pins = kernel_pins()
    saved = {k: os.environ.get(k) for k in pins}
    os.environ.update(pins)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _build(recipe: str, cache_dir: Path, out_dir: Path, plan: dict[str, Attributes], workers: int, progress: bool) -> list[ManifestRow]:
    """Build the planned adapters in fresh worker processes with pinned CPU kernels, the base first, then the
    roots, then the members made from them (a lineage zoo's)."""
    rows = []
    ctx = multiprocessing.get_context("spawn")
    with _pinned_kernels(), ProcessPoolExecutor(min(workers, len(plan)), mp_context=ctx, initializer=_init_worker) as pool:
        prepared = pool.submit(_prepare, recipe, cache_dir)  # pretrain and cache the base once, before any worker needs it
        _wait_showing(prepared, f"{recipe} base model (once, then cached)", progress)
        # the adapters' bar starts after the base, so its rate and ETA are the adapters' own
        bar = tqdm(total=len(plan), desc=f"make-zoo {recipe}", unit="adapter", disable=not progress)
        roots = {n: a for n, a in plan.items() if a.get("relation", "root") == "root"}
        for stage in (roots, {n: a for n, a in plan.items() if n not in roots}):
            for fut in as_completed([pool.submit(build_one, recipe, cache_dir, out_dir, n, a) for n, a in stage.items()]):
                rows.append(fut.result())
                bar.update()
    bar.close()
    return rows


def _wait_showing(future: Future, what: str, progress: bool) -> None:
    """Wait for a preparation step with a bar of its own that shows the time spent (a step with no count has no
    honest ETA): counting it as one adapter made the adapters' first rate, and so their ETA, an hour long."""
    with tqdm(total=1, desc=f"preparing the {what}", bar_format="{desc}: {elapsed}", disable=not progress) as bar:
        while not _done_within(future, 1.0):
            bar.refresh()
        bar.update()


def _done_within(future: Future, seconds: float) -> bool:
    """Whether the future finished within `seconds` (its exception, if any, is raised)."""
    try:
        future.result(timeout=seconds)
    except FutureTimeout:
        return False
    return True


def _finished(out_dir: Path, name: str, attrs: Attributes, recipe: str) -> ManifestRow | None:
    path = out_dir / name / ATTRIBUTES_FILE
    if not path.exists():
        return None
    row = json.loads(path.read_text())
    if row.get("recipe") != recipe or any(row.get(k) != v for k, v in attrs.items()):
        raise ZooError(
            f"{out_dir / name} was built with other settings (recipe or seed) than this run's: "
            "use a new OUT_DIR or the original --seed/--recipe"
        )
    return row


def make_zoo(
    out_dir: Path,
    recipe: str,
    count: int,
    seed: int = 0,
    workers: int = 1,
    cache_dir: Path | None = None,
    progress: bool = True,
    mix: Mix | None = None,
) -> ZooReport:
    """Build (or finish building) `count` adapters of `recipe` in out_dir and write labels.csv. `mix`: a lineage
    recipe's share of each kind of member (None: the defaults).

    Returns a report: counts, timings, the spread of test accuracy by attribute, disk size.
    """
    r = get_recipe(recipe)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(cache_dir) if cache_dir else out_dir / ".cache"
    t_start = time.perf_counter()
    plan = plan_zoo(recipe, seed, count, mix)
    rows: dict[str, ManifestRow] = {}
    for name, attrs in plan.items():
        done = _finished(out_dir, name, attrs, recipe)
        if done is not None:
            rows[name] = done
    todo = [n for n in plan if n not in rows]
    skipped = len(rows)
    if todo:
        for row in _build(recipe, cache_dir, out_dir, {n: plan[n] for n in todo}, max(1, workers), progress):
            rows[row["name"]] = row
    ordered = [rows[n] for n in plan]
    write_labels(out_dir / LABELS_FILE, ordered)
    elapsed = time.perf_counter() - t_start
    built_times = [float(rows[n]["train_seconds"]) for n in todo]
    return {
        "out_dir": str(out_dir),
        "recipe": recipe,
        "base_model": r.base_model,
        "count": count,
        "seed": seed,
        "built": len(todo),
        "skipped": skipped,
        "seconds": round(elapsed, 1),
        "train_seconds_per_adapter": round(statistics.mean(built_times), 3) if built_times else None,
        "cpu_kernels": ", ".join(sorted({str(rows[n]["cpu_kernels"]) for n in todo})) or None,
        "disk_bytes": sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file() and ".cache" not in p.parts),
        "labels": str(out_dir / LABELS_FILE),
        "accuracy": with_task_reference(accuracy_spread(ordered), r, cache_dir),
    }


def with_task_reference(spread: AccuracySpread, r: Recipe, cache_dir: Path) -> AccuracySpread:
    """The spread with each task's chance accuracy and the base model's own accuracy on it (no adapter): what
    an adapter's test accuracy is to be read against."""
    tasks = spread.get("by", {}).get("task", {})
    if tasks:
        for task, s in tasks.items():
            parts = task.split(lineage.TASKS_SEP)  # a merge's task is its parents' (mean over them)
            bases = [_base_accuracy(r, cache_dir, t) for t in parts]
            s["chance"] = round(statistics.mean(r.chance(t) for t in parts), 3)
            s["base"] = round(statistics.mean(b for b in bases if b is not None), 3) if None not in bases else None
    return spread


def write_labels(path: Path, rows: list[ManifestRow]) -> None:
    columns = [k for k in rows[0] if k not in NOT_LABELS] if rows else ["name"]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def _sort_key(value: str) -> tuple[int, float, str]:
    try:
        return (0, float(value), "")
    except ValueError:
        return (1, 0.0, value)


def accuracy_spread(rows: list[ManifestRow]) -> AccuracySpread:
    """Test accuracy overall and by value of each attribute (mean, min, max, n)."""
    if not rows:
        return {}
    acc = [float(r["test_accuracy"]) for r in rows]

    def summary(values: list[float]) -> Spread:
        return {"mean": round(statistics.mean(values), 3), "min": round(min(values), 3), "max": round(max(values), 3), "n": len(values)}

    columns: list[Mapping[str, object]] = list(rows)  # read by attribute name
    by: dict[str, dict[str, Spread]] = {}
    for key in columns[0]:
        if key in (*NOT_GROUPED, *NOT_LABELS):
            continue
        groups: dict[str, list[float]] = defaultdict(list)
        for r, a in zip(columns, acc, strict=True):
            if r[key] is not None:  # a lineage member has no value for another kind's parameters
                groups[str(r[key])].append(a)
        by[key] = {v: summary(g) for v, g in sorted(groups.items(), key=lambda kv: _sort_key(kv[0]))}
    rated = [(float(lr), a) for r, a in zip(columns, acc, strict=True) if isinstance(lr := r.get("learning_rate"), int | float)]
    if len(rated) >= 4:
        edges = np.quantile([lr for lr, _ in rated], [0.25, 0.5, 0.75])
        bins: dict[str, list[float]] = defaultdict(list)
        for value, a in rated:
            bins[f"q{int(np.searchsorted(edges, value)) + 1}"].append(a)
        by["learning_rate_quartile"] = {k: summary(v) for k, v in sorted(bins.items())}
    return {"overall": {**summary(acc), "std": round(statistics.pstdev(acc), 3)}, "by": by}
