"""Benchmark: similar-by-id queries through the query engine on one synthetic space of N adapters.

The space is SYNTHETIC, derived from a real reference zoo: every synthetic adapter mixes two of
the zoo's real adapters (weights u and 1 - u, u uniform in [0.5, 1]) plus Gaussian noise, in
both of its stored representations. The module sketch is mixed as stored (each present module's
block has expected squared norm 1, see `zoo.domain.similarity.module_sketches`), its present blocks get
noise of the same relative size whatever the probes per module, and the whole vector is scaled to
norm √(modules present), as a real sketch is; the W2T embedding is mixed, noised and made unit.
It inherits the task of its main parent, so neighbourhoods have the zoo's structure (reported:
same-task hit@1 of the exact nearest, in the real zoo and in the synthetic space); a `shard` label
with 100 values gives a filter that keeps 1 % of the zoo. There are no blobs, so no module store:
module cosine comes from the sketches, as in any space too big for the store.

The real zoo is either given (`--zoo-data-dir`: a data dir where `zoo embed` and `zoo train` ran)
or built (`--kind KIND`: `--source-families` × `--source-members` adapters of a kind of
`zoo.reference.real_shapes.MODELS` at their real shapes, or their first `--source-layers` blocks,
ingested with their family as `task`, `zoo embed`, `zoo train`), once per recipe under a cache dir
(`--source-dir`), reused by later runs.

Where the zoo has input-Gram sketches (`zoo embed` writes them), they are mixed from the same parents with the same
weights and noised like the module sketches (a mixture's Gram is not the mixture of the Grams: the neighbourhoods are
the space's, not real adapters'), and `--method input_gram` is served and measured too: with no module store its score
is the input Gram estimated from these sketches, and its first stage is the union of both sketch indexes' nearest
(embed/serving/search_methods.py EXACT_CANDIDATES); the same queries are answered again with the module sketch's candidates alone (the
first stage before the input-Gram index: the baseline) and with the input-Gram sketch's alone.

Build (timed, in a child process so the serving process's memory is its own): a SQLite database
with the adapters, their labels and their embeddings, written in bulk, then every FAISS index (IVF above 100k
adapters) read back from it as `zoo index` builds one (embed/serving/index_files.py build_index), one at a time: built, saved and
freed before the next, so the build's memory peaks at the largest index's, not their sum. Serve: the engine loads the
space, then answers `--queries` queries by stored id with the default method (hybrid) single-threaded, with 8 concurrent threads, and with a
1 % label filter (and input_gram single-threaded and filtered). Recall@10 compares the served top 10 with an
exhaustive ranking by the same score over all N adapters (computed chunk by chunk from the generator: the baseline,
timed per query).

    python -m bench.serve --adapters 1000000 --zoo-data-dir DIR
    python -m bench.serve --adapters 1000000 --kind llama3-8b --work /big/disk/serve-llama

Prints a table and, on the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import multiprocessing
import os
import queue
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# before FAISS's OpenMP starts (here and in the spawned build): see embed/serving/index.py; the engine imports FAISS first
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

CHUNK = 50_000
#: the exact ranking is kept this deep, to report how far the 10th neighbour's score is from this one's
GAP_RANK = 50
SHARDS = 100


@dataclass
class Source:
    """The real zoo's vectors the synthetic adapters are mixed from."""

    sketches: np.ndarray  # (n, modules·width), as stored: a present module's block has expected squared norm 1
    w2t: np.ndarray  # (n, dim), unit
    tasks: list[str]
    n_modules: int
    sketch_config: dict
    w2t_checkpoint: str
    w2t_config: dict
    noise: float
    #: (n, dim) raw-factor sketches and their embedder's config, where the zoo has them (the relation step's second
    #: neighbourhood, zoo/services/relations.py)
    raw: np.ndarray | None = None
    raw_config: dict | None = None
    #: (n, modules·width) input-Gram sketches (scaled as the module sketches) and their embedder's config, where the zoo
    #: has them (input_gram search's first stage)
    gram: np.ndarray | None = None
    gram_config: dict | None = None

    @property
    def width(self) -> int:
        """Probe values per module."""
        return self.sketches.shape[1] // self.n_modules

    @functools.cached_property
    def present(self) -> np.ndarray:
        """(n, modules) bool: the modules each real adapter has (a nonzero block)."""
        return np.abs(self.sketches.reshape(len(self.sketches), self.n_modules, -1)).max(axis=2) > 0


def _zoo_vectors(
    database_url: str, data_dir: Path, method: str, optional: bool = False
) -> tuple[dict[str, np.ndarray], dict[str, str], object]:
    """(name → stored vector, name → given task, the active embedder) of one embedder of a zoo's only space; with
    `optional`, no vectors and None where the space has no such embedder."""
    from sqlalchemy import select

    from embed.serving.resources import resolve_space
    from zoo.store.embedders import active_embedder
    from zoo.store.embeddings import load_embeddings
    from zoo.store.models import Adapter, Label
    from zoo.store.session import session_factory

    with session_factory(database_url)() as session:
        space = resolve_space(session, None)
        embedder = active_embedder(session, space, method)
        if embedder is None and optional:
            return {}, {}, None
        if embedder is None or (method == "w2t" and embedder.objective == "contrastive"):
            raise SystemExit(
                f"{data_dir}: the bench needs a zoo with module sketches and a supervised W2T: run `zoo embed` and `zoo train`"
            )
        ids, vectors = load_embeddings(session, embedder)
        names = dict(session.execute(select(Adapter.id, Adapter.name)).all())
        given = select(Adapter.name, Label.value).join(Label).where(Label.key == "task", Label.source == "given")
        tasks = dict(session.execute(given).all())
        session.expunge(embedder)
        return {names[int(i)]: v for i, v in zip(ids, vectors, strict=True)}, tasks, embedder


def load_source(
    database_url: str, data_dir: Path, noise: float, w2t_database_url: str | None = None, w2t_data_dir: Path | None = None
) -> Source:
    """The real zoo's sketches and supervised W2T vectors, matched by adapter name; the W2T ones from another zoo of the
    same adapters where given (`w2t_database_url`, `w2t_data_dir`)."""
    sketches, tasks, sketch = _zoo_vectors(database_url, data_dir, "module_sketch")
    w2t_dir = w2t_data_dir or data_dir
    w2t_vectors, _, w2t = _zoo_vectors(w2t_database_url or database_url, w2t_dir, "w2t")
    raw, _, raw_embedder = _zoo_vectors(database_url, data_dir, "raw_factors", optional=True)
    gram, _, gram_embedder = _zoo_vectors(database_url, data_dir, "input_gram_sketch", optional=True)
    names = sorted(sketches.keys() & w2t_vectors.keys())
    return Source(
        np.stack([sketches[n] for n in names]).astype(np.float32),
        np.stack([w2t_vectors[n] for n in names]).astype(np.float32),
        [tasks.get(n, "") for n in names],
        len(sketch.config["schema"]["modules"]),  # type: ignore[attr-defined]
        dict(sketch.config),  # type: ignore[attr-defined]
        str((w2t_dir / str(w2t.checkpoint)).resolve()),  # type: ignore[attr-defined]
        dict(w2t.config),  # type: ignore[attr-defined]
        noise,
        np.stack([raw[n] for n in names]).astype(np.float32) if raw_embedder is not None else None,
        dict(raw_embedder.config) if raw_embedder is not None else None,  # type: ignore[attr-defined]
        np.stack([gram[n] for n in names]).astype(np.float32) if gram_embedder is not None else None,
        dict(gram_embedder.config) if gram_embedder is not None else None,  # type: ignore[attr-defined]
    )


def source_root(args: argparse.Namespace) -> Path:
    """Where the real zoos of `--kind` are built and kept: --source-dir, else a cache dir."""
    if args.source_dir is not None:
        return args.source_dir  # type: ignore[no-any-return]
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "zoo-bench-serve"


def run_bounded(command: list[str], env: dict[str, str], max_rss_gb: float) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    """Run a command; kill it (and exit) when its resident memory, children included, passes `max_rss_gb` (a
    shared machine: better a failed bench than the kernel's OOM killer choosing someone else's process)."""
    import psutil

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=err, text=True)
        peak = 0.0
        while proc.poll() is None:
            try:
                tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
                peak = max(peak, sum(q.memory_info().rss for q in tree) / 2**30)
            except psutil.NoSuchProcess:
                pass
            if peak > max_rss_gb:
                proc.kill()
                proc.wait()
                sys.exit(f"{' '.join(command)} passed {max_rss_gb} GB of resident memory: killed (--source-max-rss-gb)")
            time.sleep(0.5)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, proc.returncode, out.read(), err.read())


def build_zoo(args: argparse.Namespace, layers: int | None, train: bool) -> tuple[Path, dict]:
    """The data dir of a real zoo of `args.kind` and how it was built: families × members adapters at their real
    shapes (or their first `layers` blocks), ingested with `task` = family, `zoo embed`, and `zoo train` if `train`.
    Built once per recipe: a later run finds `source.json` (written last) and reuses the zoo; a partial one is
    built again. Its blobs and module store are removed when it is done (GBs at real sizes, read by no bench step)."""
    from zoo.reference.real_shapes import MODELS, write_zoo

    recipe = f"{args.kind}-{args.source_families}x{args.source_members}-layers-{layers if layers is not None else 'all'}"
    if train:
        recipe += f"-e{args.source_epochs}-m{args.source_train_members}"
    root = source_root(args) / recipe
    done = root / "source.json"
    if done.exists():
        return root / "data", json.loads(done.read_text())
    shutil.rmtree(root, ignore_errors=True)
    data = root / "data"
    files = root / "files"
    env = {**os.environ, "ZOO_DATA_DIR": str(data)}
    env.pop("ZOO_DATABASE_URL", None)
    zoo = [sys.executable, "-m", "zoo.cli"]
    model = MODELS[args.kind]
    figures: dict[str, object] = {
        "families": args.source_families,
        "members": args.source_members,
        "layers": layers,
        "modules": len(model.modules(layers)),
    }

    def step(name: str, command: list[str]) -> None:
        t0 = time.perf_counter()
        proc = run_bounded(command, env, args.source_max_rss_gb)
        if proc.returncode:
            sys.exit(f"{' '.join(command)} failed (exit status {proc.returncode}):\n{proc.stderr[-3000:]}")
        figures[f"{name}_s"] = round(time.perf_counter() - t0, 1)
        print(f"source zoo {recipe}: {name} {figures[f'{name}_s']} s", file=sys.stderr, flush=True)

    step("init", [*zoo, "init"])
    t0 = time.perf_counter()
    written = write_zoo(args.kind, files, args.source_families, args.source_members, layers)
    figures["write_s"] = round(time.perf_counter() - t0, 1)
    labels = root / "labels.csv"
    with labels.open("w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["name", "task"])
        out.writerows([path.name, f"f{family}"] for path, family in written)
    step("ingest", [*zoo, "ingest", "--no-embed", str(files), "--base-model", model.base_model, "--labels", str(labels), "--json"])
    shutil.rmtree(files)  # the blobs hold what embed and train read
    step("embed", [*zoo, "embed", "--space", model.base_model])
    if train:
        figures["epochs"], figures["train_members"] = args.source_epochs, args.source_train_members
        schedule = ["--epochs", str(args.source_epochs), "--members", str(args.source_train_members)]
        step("train", [*zoo, "train", "--space", model.base_model, *schedule])
    for derived in ("blobs", "rerank"):  # the bench reads the embeddings and the checkpoint only
        shutil.rmtree(data / derived, ignore_errors=True)
    done.write_text(json.dumps(figures))
    return data, figures


def build_sources(args: argparse.Namespace) -> tuple[Path, Path, dict]:
    """(data dir of the sketches, data dir of the W2T embeddings, figures) of the real zoo of `--kind`: one zoo at
    --source-layers, trained; or, with --train-layers, the sketches of that zoo and the W2T embeddings of the same
    adapters cut to their first --train-layers blocks (a zoo of its own, trained: for sizes whose `zoo train` does not
    fit in memory)."""
    from zoo.reference.real_shapes import MODELS

    figures: dict[str, object] = {"kind": args.kind, "base_model": MODELS[args.kind].base_model}
    if args.train_layers is None:
        data, figures["zoo"] = build_zoo(args, args.source_layers, train=True)
        return data, data, figures
    sketch_data, figures["sketch_zoo"] = build_zoo(args, args.source_layers, train=False)
    w2t_data, figures["w2t_zoo"] = build_zoo(args, args.train_layers, train=True)
    return sketch_data, w2t_data, figures


def as_sketch(x: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Mixed sketch vectors (float32, changed in place) scaled as `module_sketches` writes them: norm √(modules
    present), absent blocks zero. (Not per block: with one probe a module, unit blocks would make every coordinate ±1.)"""
    x = np.asarray(x, np.float32)
    blocks = x.reshape(len(x), present.shape[1], -1)
    blocks *= present[:, :, None]  # in place (x is the caller's scratch)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    x *= np.sqrt(present.sum(axis=1, keepdims=True)) / np.maximum(norms, 1e-12)
    return x


def sketch_noise(src: Source, width: int | None = None) -> float:
    """Per-coordinate noise of sketches of `width` probes a module (the module sketch's by default): `noise` at
    MODULE_SKETCH_DIM probes a module, and √(MODULE_SKETCH_DIM / width) times that at fewer, so that every module's
    block gets noise of the same norm relative to its own (1)."""
    from zoo.domain.similarity import MODULE_SKETCH_DIM

    return src.noise * float(np.sqrt(MODULE_SKETCH_DIM / (width or src.width)))


def parents(src: Source, start: int, stop: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(main parent, other parent) of synthetic adapters start..stop-1 (those `synthetic_chunk` mixes)."""
    _, a, b, _ = mixture(src, start, stop, seed)
    return a, b


def mixture(src: Source, start: int, stop: int, seed: int) -> tuple[np.random.Generator, np.ndarray, np.ndarray, np.ndarray]:
    """(the generator, main parents, other parents, main weights) of synthetic adapters start..stop-1, the same on
    every call; the generator goes on to their noise."""
    rng = np.random.default_rng([seed, start])
    n = stop - start
    a, b = rng.integers(0, len(src.tasks), n), rng.integers(0, len(src.tasks), n)
    return rng, a, b, rng.uniform(0.5, 1.0, (n, 1)).astype(np.float32)


def synthetic_chunk(src: Source, start: int, stop: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sketches, w2t vectors, main parents) of synthetic adapters start..stop-1, the same on every call."""
    rng, a, b, u = mixture(src, start, stop, seed)
    n = stop - start
    sk = src.sketches[a] * u  # in place from here: a chunk at 2,048 dimensions is 400 MB an array
    sk += (1 - u) * src.sketches[b]
    sk += sketch_noise(src) * rng.standard_normal((n, src.sketches.shape[1]), dtype=np.float32)
    w = u * src.w2t[a] + (1 - u) * src.w2t[b] + src.noise * rng.standard_normal((n, src.w2t.shape[1]), dtype=np.float32)
    present = src.present
    return as_sketch(sk, present[a] | present[b]), (w / np.linalg.norm(w, axis=1, keepdims=True)).astype(np.float32), a


def synthetic_raw(src: Source, start: int, stop: int, seed: int) -> np.ndarray:
    """The raw-factor sketches of synthetic adapters start..stop-1, mixed from the same parents with the same weights as
    `synthetic_chunk`'s, noised as the W2T vectors are and made unit."""
    assert src.raw is not None
    _, a, b, u = mixture(src, start, stop, seed)
    noise = np.random.default_rng([seed, 2, start]).standard_normal((stop - start, src.raw.shape[1]), dtype=np.float32)
    r = u * src.raw[a] + (1 - u) * src.raw[b] + src.noise * noise
    return (r / np.maximum(np.linalg.norm(r, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def synthetic_gram(src: Source, start: int, stop: int, seed: int) -> np.ndarray:
    """The input-Gram sketches of synthetic adapters start..stop-1, mixed from the same parents with the same weights as
    `synthetic_chunk`'s, noised and scaled as its module sketches are."""
    assert src.gram is not None
    _, a, b, u = mixture(src, start, stop, seed)
    g = src.gram[a] * u
    g += (1 - u) * src.gram[b]
    noise = np.random.default_rng([seed, 3, start]).standard_normal((stop - start, src.gram.shape[1]), dtype=np.float32)
    g += sketch_noise(src, src.gram.shape[1] // src.n_modules) * noise
    return as_sketch(g, src.present[a] | src.present[b])


def chunks(n: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, CHUNK):
        yield start, min(n, start + CHUNK)


def build(src: Source, n: int, work: Path, seed: int) -> dict[str, float]:
    """Write the synthetic space's database and index files under `work` (runs in a child process)."""
    from sqlalchemy import insert

    from embed.serving.index_files import build_index, index_path
    from zoo.store.models import Adapter, Embedder, Embedding, EmbeddingSpace, Label
    from zoo.store.session import make_engine, session_factory, upgrade

    t0 = time.perf_counter()
    url = f"sqlite:///{work / 'zoo.db'}"
    upgrade(url)
    # the sketch embedders after the module sketch's and W2T's, where the zoo has them, and how each is mixed
    sketches = [
        (m, v, c)
        for m, v, c in (("raw_factors", src.raw, src.raw_config), ("input_gram_sketch", src.gram, src.gram_config))
        if v is not None
    ]
    makers = [{"raw_factors": synthetic_raw, "input_gram_sketch": synthetic_gram}[m] for m, _, _ in sketches]
    engine = make_engine(url)
    base = "synthetic/" + src.sketch_config["schema"]["base_model"]
    with engine.begin() as conn:
        conn.execute(insert(EmbeddingSpace).values(id=1, name=base, base_model=base, schema=src.sketch_config["schema"], version=1))
        conn.execute(
            insert(Embedder).values(
                id=1, space_id=1, method="module_sketch", dim=src.sketches.shape[1], config=src.sketch_config, active=True
            )
        )
        conn.execute(
            insert(Embedder).values(
                id=2,
                space_id=1,
                method="w2t",
                objective="supervised",
                checkpoint=src.w2t_checkpoint,
                dim=src.w2t.shape[1],
                config=src.w2t_config,
                active=True,
            )
        )
        for embedder_id, (method, vectors, config) in enumerate(sketches, 3):
            conn.execute(
                insert(Embedder).values(id=embedder_id, space_id=1, method=method, dim=vectors.shape[1], config=config, active=True)
            )
    methods = ("module_sketch", "w2t", *(method for method, _, _ in sketches))  # embedders 1, 2, 3, ...
    embedder_ids = tuple(range(1, len(methods) + 1))

    def vectors_of(start: int, stop: int) -> tuple[list[np.ndarray], np.ndarray]:
        sk, w, parent = synthetic_chunk(src, start, stop, seed)
        return [sk, w, *(make(src, start, stop, seed) for make in makers)], parent

    steps = dict.fromkeys(("generate_s", "sql_s"), 0.0)
    t = time.perf_counter()

    def lap(step: str) -> None:
        nonlocal t
        steps[step] = steps.get(step, 0.0) + time.perf_counter() - t
        t = time.perf_counter()

    for start, stop in chunks(n):
        vectors_now, parent = vectors_of(start, stop)
        ids = np.arange(start + 1, stop + 1)
        lap("generate_s")
        with engine.begin() as conn:
            conn.execute(
                insert(Adapter),
                [
                    {
                        "id": int(i),
                        "name": f"syn-{i:07d}",
                        "source_uri": f"synthetic://{i}",
                        "base_model": base,
                        "format": "peft",
                        "rank": 8,
                        "canonical_hash": f"{i:064x}",
                        "structure_hash": "0" * 64,
                        "file_sha256": "0" * 64,
                        "size_bytes": 0,
                        "config": {},
                        "file_metadata": {},
                        "extra_tensors": {},
                        "notes": [],
                    }
                    for i in ids.tolist()
                ],
            )
            conn.execute(
                insert(Label),
                [{"adapter_id": int(i), "key": "task", "value": src.tasks[p], "source": "given"} for i, p in zip(ids, parent, strict=True)]
                + [{"adapter_id": int(i), "key": "shard", "value": f"s{i % SHARDS}", "source": "given"} for i in ids.tolist()],
            )
            for embedder_id, vectors in zip(embedder_ids, vectors_now, strict=True):
                conn.execute(
                    insert(Embedding),
                    [
                        {"adapter_id": int(i), "embedder_id": embedder_id, "vector": v.tobytes(), "version": 1}
                        for i, v in zip(ids, vectors, strict=True)
                    ],
                )
        lap("sql_s")
    db_s = time.perf_counter() - t0
    figures: dict[str, list] = {"nprobe": [], "rerank": [], "store": []}
    database_cpu_s = time.process_time()
    indexes: dict[str, dict[str, float]] = {}
    with session_factory(url)() as session:
        for embedder_id, method in zip(embedder_ids, methods, strict=True):
            # one index at a time, as `zoo index` builds them: read from the database, saved, freed before the next
            cpu, begun = time.process_time(), time.perf_counter()
            index = build_index(session, session.get_one(Embedder, embedder_id))
            built_s = time.perf_counter() - begun
            index.save(index_path(work, embedder_id), {"embedder_id": embedder_id, "version": 1})
            for key, value in (("nprobe", index.nprobe), ("rerank", index.rerank), ("store", index.store)):
                figures[key].append(value)
            indexes[method] = index_steps(index.timings, built_s, time.perf_counter() - begun - built_s, time.process_time() - cpu)
            del index
            lap(f"index_{method}_s")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "build_s": time.perf_counter() - t0,
        "build_cpu_s": usage.ru_utime + usage.ru_stime,  # the child's own: on a busy machine, wall time is not its cost
        "database_cpu_s": database_cpu_s,
        "peak_rss_gb": usage.ru_maxrss / 2**20,  # the child's own (KiB)
        "database_s": db_s,
        "database_gb": (work / "zoo.db").stat().st_size / 1e9,
        "steps_s": {k: round(v, 1) for k, v in steps.items()},
        "index_steps_s": indexes,
        "machine": machine(),
        **figures,
    }  # type: ignore[dict-item]


def index_steps(timings: dict[str, float], built_s: float, save_s: float, cpu_s: float) -> dict[str, float]:
    """One index's build in steps (seconds): FAISS's training (the IVF's quantizer and codes, the store's range, the
    subset codes), adding, tuning, the rest of building it (reading its vectors from the database: the part that
    waits on the disk where the database is not in the page cache) and saving its file; and the process's CPU seconds
    over all of them (at most wall × cores: a busy machine's wall time is longer, not its CPU time)."""
    faiss_s = sum(timings.values())
    return {
        **{k: round(v, 1) for k, v in timings.items()},
        "read_s": round(max(0.0, built_s - faiss_s), 1),
        "save_s": round(save_s, 1),
        "cpu_s": round(cpu_s, 1),
    }


def machine() -> dict[str, float]:
    """What the build's and the serve's times and memory depend on beyond the bench: cores, load average, memory, the
    page cache (GB of /proc/meminfo: files read or written lately, dropped under memory pressure)."""
    info = {line.split(":")[0]: int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()}
    return {
        "cores": os.cpu_count() or 0,
        "load_1min": round(os.getloadavg()[0], 2),
        "memory_gb": round(info.get("MemTotal", 0) / 2**20, 1),
        "available_gb": round(info.get("MemAvailable", 0) / 2**20, 1),
        "page_cache_gb": round(info.get("Cached", 0) / 2**20, 1),
    }


def _build_in_child(src: Source, n: int, work: Path, seed: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    out.put(build(src, n, work, seed))


def build_or_reuse(src: Source, n: int, work: Path, seed: int, reuse: bool) -> dict:
    """The build's figures: read from `work/build.json` (reuse), or from a build in a child process (so that the
    serving process's memory is its own), then saved there."""
    if reuse:
        return json.loads((work / "build.json").read_text())  # type: ignore[no-any-return]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_build_in_child, args=(src, n, work, seed, out))
    child.start()
    while True:  # a child killed (for memory, say) puts nothing: wait for it no longer than it lives
        try:
            built = out.get(timeout=5)
            break
        except queue.Empty:
            if not child.is_alive():
                sys.exit(f"the build process ended with exit code {child.exitcode} before its figures (-9: killed, e.g. for memory)")
    child.join()
    (work / "build.json").write_text(json.dumps(built))
    return built  # type: ignore[no-any-return]


def rss_gb() -> float:
    return memory_gb()["rss"]


def memory_gb() -> dict[str, float]:
    """The process's resident memory (VmRSS, GiB) and its parts (/proc/self/status): anonymous (RssAnon: its own heap,
    what it alone holds) and file-backed (RssFile: pages of files it maps, e.g. mapped index files, which are the page
    cache's: shared, dropped by the kernel under memory pressure and read from disk again when touched), and its peak
    (VmHWM)."""
    keys = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem", "VmHWM": "peak"}
    out = dict.fromkeys(keys.values(), float("nan"))
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in keys:
            out[keys[key]] = int(line.split()[1]) / 2**20
    return out


def percentiles(times: list[float]) -> tuple[float, float]:
    return float(np.percentile(times, 50) * 1e3), float(np.percentile(times, 99) * 1e3)


def exhaustive_top(
    src: Source, n: int, seed: int, queries: np.ndarray, weight: float, k: int, shards: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, float]:
    """Top-k ids of each query by the served score (hybrid's) over all N (the baseline), their scores, and its time per
    query; with `shards`, each query's over the adapters of its shard only (the filtered baseline)."""
    from zoo.domain.similarity import hybrid_score, sketch_module_cosines

    def vectors(start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        sk, w, _ = synthetic_chunk(src, start, stop, seed)
        return sk, w

    (q_sk, q_w), chunk_vectors = stored_vectors(n, queries, vectors)
    return exhaustive(
        n,
        queries,
        k,
        lambda vs: hybrid_score(sketch_module_cosines(q_sk, vs[0], src.n_modules), q_w @ vs[1].T, weight),
        chunk_vectors,
        shards,
    )


def exhaustive_gram_top(
    src: Source, n: int, seed: int, queries: np.ndarray, k: int, shards: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, float]:
    """exhaustive_top for input_gram: the input Gram as served without a module store, estimated from the input-Gram
    sketches (`sketch_module_cosines`, as from the module sketches)."""
    from zoo.domain.similarity import sketch_module_cosines

    def vectors(start: int, stop: int) -> tuple[np.ndarray]:
        return (synthetic_gram(src, start, stop, seed),)

    (q_g,), chunk_vectors = stored_vectors(n, queries, vectors)
    return exhaustive(n, queries, k, lambda vs: sketch_module_cosines(q_g, vs[0], src.n_modules), chunk_vectors, shards)


def stored_vectors(
    n: int, queries: np.ndarray, vectors: Callable[[int, int], tuple[np.ndarray, ...]]
) -> tuple[tuple[np.ndarray, ...], Callable[[int, int], tuple[np.ndarray, ...]]]:
    """The queries' own vectors, as stored (each of `vectors`' arrays at the queries' rows), and `vectors` itself."""
    got: list[np.ndarray] = []
    for start, stop in chunks(n):
        inside = np.nonzero((queries > start) & (queries <= stop))[0]
        if len(inside):
            arrays = vectors(start, stop)
            if not got:
                got = [np.zeros((len(queries), a.shape[1]), np.float32) for a in arrays]
            for out, a in zip(got, arrays, strict=True):
                out[inside] = a[queries[inside] - 1 - start]
    return tuple(got), vectors


def exhaustive(
    n: int,
    queries: np.ndarray,
    k: int,
    score: Callable[[tuple[np.ndarray, ...]], np.ndarray],
    vectors: Callable[[int, int], tuple[np.ndarray, ...]],
    shards: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, float]:
    """Top-k ids of each query by `score` of each chunk's `vectors` over all N, their scores and the time per query (the
    query itself left out; with `shards`, only its shard's adapters)."""
    t0 = time.perf_counter()
    best_s = np.full((len(queries), 0), -np.inf)
    best_i = np.zeros((len(queries), 0), dtype=np.int64)
    for start, stop in chunks(n):
        s = score(vectors(start, stop))
        ids = np.arange(start + 1, stop + 1)
        s[ids[None, :] == queries[:, None]] = -np.inf
        if shards is not None:
            s[ids[None, :] % SHARDS != shards[:, None]] = -np.inf
        all_s = np.concatenate([best_s, s], axis=1)
        all_i = np.concatenate([best_i, np.broadcast_to(ids, s.shape)], axis=1)
        top = np.argpartition(-all_s, k, axis=1)[:, :k]
        best_s, best_i = np.take_along_axis(all_s, top, 1), np.take_along_axis(all_i, top, 1)
    order = np.argsort(-best_s, axis=1, kind="stable")
    return np.take_along_axis(best_i, order, 1), np.take_along_axis(best_s, order, 1), (time.perf_counter() - t0) / len(queries)


def main_parents(src: Source, ids: np.ndarray, seed: int) -> np.ndarray:
    """The main parent (a real adapter's row) of each synthetic adapter id."""
    out = np.zeros(len(ids), np.int64)
    for start, stop in chunks(int(ids.max())):
        inside = np.nonzero((ids > start) & (ids <= stop))[0]
        if len(inside):
            out[inside] = parents(src, start, stop, seed)[0][ids[inside] - 1 - start]
    return out


def real_task_hit_at_1(src: Source, weight: float) -> float:
    """Share of the real adapters whose nearest other real adapter by the served score has their task."""
    from zoo.domain.similarity import hybrid_score, sketch_module_cosines

    s = hybrid_score(sketch_module_cosines(src.sketches, src.sketches, src.n_modules), src.w2t @ src.w2t.T, weight)
    np.fill_diagonal(s, -np.inf)
    tasks = np.array(src.tasks)
    return float(np.mean(tasks[s.argmax(axis=1)] == tasks))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=100_000)
    p.add_argument("--zoo-data-dir", type=Path, help="data dir of the real zoo (default: $ZOO_DATA_DIR)")
    p.add_argument("--zoo-db", help="its database URL (default: SQLite in the data dir)")
    p.add_argument("--work", type=Path, help="where to build the synthetic space (default: a temporary dir, removed)")
    p.add_argument("--reuse", action="store_true", help="serve the space already built in --work (same --adapters, --seed, --noise)")
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--recall-queries", type=int, default=50)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument(
        "--blas-threads", type=int, help="limit the serving process's BLAS threads (threadpoolctl; default: as zoo serve, the library's)"
    )
    p.add_argument("--noise", type=float, default=0.02, help="per-coordinate noise added to every mixture (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kind", help="build the real zoo instead: adapters of this kind of zoo.reference.real_shapes.MODELS")
    p.add_argument("--source-families", type=int, default=10)
    p.add_argument("--source-members", type=int, default=4, help="adapters per family (default: %(default)s)")
    p.add_argument("--source-layers", type=int, help="keep the first N blocks of the model (default: all, the real size)")
    p.add_argument("--source-epochs", type=int, default=10, help="zoo train --epochs (default: %(default)s)")
    p.add_argument("--source-train-members", type=int, default=1, help="zoo train --members (default: %(default)s)")
    p.add_argument(
        "--train-layers", type=int, help="W2T embeddings from the same adapters cut to their first N blocks (where full ones do not train)"
    )
    p.add_argument("--source-max-rss-gb", type=float, default=12.0, help="kill a source zoo step above this resident memory")
    p.add_argument("--source-dir", type=Path, help="where the real zoos of --kind are built and kept (default: ~/.cache/zoo-bench-serve)")
    args = p.parse_args()

    from zoo.config import Settings

    source: dict | None = None
    if args.kind:
        sketch_dir, w2t_dir, source = build_sources(args)
        src = load_source(f"sqlite:///{sketch_dir / 'zoo.db'}", sketch_dir, args.noise, f"sqlite:///{w2t_dir / 'zoo.db'}", w2t_dir)
    else:
        settings = Settings.load(args.zoo_db, args.zoo_data_dir)
        src = load_source(settings.database_url, settings.data_dir, args.noise)
    work = args.work or Path(tempfile.mkdtemp(prefix="zoo-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        result = serve(src, args, work, build_or_reuse(src, args.adapters, work, args.seed, args.reuse))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    result["sketch_dim"], result["w2t_dim"], result["modules"] = src.sketches.shape[1], src.w2t.shape[1], src.n_modules
    if source is not None:
        result["kind"], result["source"] = args.kind, source
    print(
        f"{result['adapters']} synthetic adapters (from {len(src.tasks)} real ones): built in {result['build_s']:.0f} s, "
        f"loaded in {result['load_s']:.1f} s, nprobe {result['nprobe']}, rerank {result['rerank']}\n"
        f"similar-by-id (hybrid, k = 10): p50 {result['p50_ms']:.2f} ms, p99 {result['p99_ms']:.2f} ms; "
        f"{args.threads} threads p99 {result['p99_ms_8_threads']:.2f} ms ({result['queries_per_s_8_threads']:.0f} queries/s); "
        f"1 % filter p50 {result['p50_ms_filtered_1pct']:.2f} ms, p99 {result['p99_ms_filtered_1pct']:.2f} ms\n"
        f"recall@10 vs exhaustive {result['recall_at_10']:.3f} (1 % filter: {result['recall_at_10_filtered_1pct']:.3f}; "
        f"exact score of the 10th minus the {GAP_RANK}th neighbour, median {result['score_gap_10th_to_50th']:.2g}); "
        f"exhaustive {result['exhaustive_ms_per_query']:.0f} ms/query "
        f"({result['speedup_vs_exhaustive']:.0f}x the served p50); resident memory {result['rss_gb']:.2f} GB "
        f"(anonymous {result['rss_anon_gb']:.2f}, mapped files {result['rss_file_gb']:.2f})\n"
        f"same-task hit@1 of the exact nearest: real zoo {result['task_hit_at_1_real']:.3f}, "
        f"synthetic {result['task_hit_at_1_synthetic']:.3f}; indexes (GB) {result['index_gb']}"
    )
    for method, parts in (result["index_steps_s"] or {}).items():
        print(f"index {method}: " + ", ".join(f"{k} {v}" for k, v in parts.items()))
    for name, g in (result["input_gram"] or {}).items():
        if isinstance(g, dict):
            print(
                f"input_gram, candidates {name}: p50 {g['p50_ms']:.2f} ms, p99 {g['p99_ms']:.2f} ms; 1 % filter p99 "
                f"{g['p99_ms_filtered_1pct']:.2f} ms; recall@10 vs exhaustive {g['recall_at_10']:.3f} "
                f"(1 % filter: {g['recall_at_10_filtered_1pct']:.3f})"
            )
    print(json.dumps(result))


def serve(src: Source, args: argparse.Namespace, work: Path, built: dict) -> dict[str, object]:
    from embed.serving.engine import QueryEngine
    from embed.serving.index_files import index_path
    from embed.serving.results import Query
    from embed.serving.space_state import index_bytes
    from zoo.store.blobs import BlobStore
    from zoo.store.session import session_factory

    sessions = session_factory(f"sqlite:///{work / 'zoo.db'}")
    engine = QueryEngine(sessions, BlobStore(work / "blobs"), work)
    if args.blas_threads is not None:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.blas_threads, user_api="blas")
    rng = np.random.default_rng(args.seed + 1)
    queries = rng.integers(1, args.adapters + 1, args.queries)
    with sessions() as session:
        space = next(iter(session.execute(__import__("sqlalchemy").text("select name from embedding_space")).scalars()))
        t0 = time.perf_counter()
        engine.space(session, space)
        load_s = time.perf_counter() - t0

    def one(i: int, filters: dict[str, str] | None = None) -> tuple[float, list[int]]:
        with sessions() as session:
            t = time.perf_counter()
            found = engine.similar(session, space, Query(f"syn-{i:07d}", int(i)), 10, filters)
            return time.perf_counter() - t, [r["adapter_id"] for r in found["results"]]

    for i in queries[:20]:  # warm-up
        one(int(i))
    single = [one(int(i)) for i in queries]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.threads) as pool:
        threaded = list(pool.map(lambda i: one(int(i))[0], queries))
    wall = time.perf_counter() - t0
    shards = rng.integers(0, SHARDS, len(queries))
    filtered = [one(int(i), {"shard": f"s{int(j)}"}) for i, j in zip(queries, shards, strict=True)]
    weight = engine.w2t(engine.space(sessions(), space).embedders["w2t"]).search.w2t_weight
    rq = queries[: args.recall_queries]
    exact, exact_scores, exhaustive_s = exhaustive_top(src, args.adapters, args.seed, rq, weight, GAP_RANK)
    recall = float(np.mean([len(set(single[j][1]) & set(exact[j, :10].tolist())) / 10 for j in range(len(rq))]))
    # how far apart the exact 10th and GAP_RANK-th neighbours score: near 0, the top 10 is decided by ties (noise)
    gap = float(np.median(exact_scores[:, 9] - exact_scores[:, GAP_RANK - 1]))
    tasks = np.array(src.tasks)
    synthetic_hit = float(np.mean(tasks[main_parents(src, exact[:, 0], args.seed)] == tasks[main_parents(src, rq, args.seed)]))
    exact_f, _, _ = exhaustive_top(src, args.adapters, args.seed, rq, weight, 10, shards[: len(rq)])
    recall_f = float(np.mean([len(set(filtered[j][1]) & set(exact_f[j].tolist())) / 10 for j in range(len(rq))]))
    p50, p99 = percentiles([t for t, _ in single])
    f50, f99 = percentiles([t for t, _ in filtered])
    gram = serve_input_gram(src, args, engine, sessions, space, queries, shards) if src.gram is not None else None
    state = engine.space(sessions(), space)
    memory = memory_gb()
    return {
        "adapters": args.adapters,
        "real_adapters": len(src.tasks),
        "p50_ms": round(p50, 3),
        "p99_ms": round(p99, 3),
        "p99_ms_8_threads": round(percentiles(threaded)[1], 3),
        "queries_per_s_8_threads": round(len(queries) / wall, 1),
        "p50_ms_filtered_1pct": round(f50, 3),
        "p99_ms_filtered_1pct": round(f99, 3),
        "recall_at_10": round(recall, 4),
        "recall_at_10_filtered_1pct": round(recall_f, 4),
        "score_gap_10th_to_50th": round(gap, 6),
        "exhaustive_ms_per_query": round(exhaustive_s * 1e3, 1),
        "speedup_vs_exhaustive": round(exhaustive_s * 1e3 / p50, 1),
        "rss_gb": round(memory["rss"], 3),
        # the parts of rss_gb: the process's own memory, and the pages of the mapped index files it has touched (the
        # page cache's, so machine-dependent: on a machine short of memory they are dropped, and read again from disk)
        "rss_anon_gb": round(memory["anon"], 3),
        "rss_file_gb": round(memory["file"], 3),
        "rss_peak_gb": round(memory["peak"], 3),
        "index_file_gb": {m: round(index_path(work, e.id).stat().st_size / 1e9, 3) for m, e in state.embedders.items()},
        "index_mapped": {m: e.index.mapped for m, e in state.embedders.items()},
        "machine_at_serve": machine(),
        "build_s": round(built["build_s"], 1),
        "build_cpu_s": round(built["build_cpu_s"], 1) if "build_cpu_s" in built else None,
        "database_s": round(built["database_s"], 1),
        "database_cpu_s": round(built["database_cpu_s"], 1) if "database_cpu_s" in built else None,
        "database_gb": round(built["database_gb"], 2) if "database_gb" in built else None,
        "build_steps_s": built.get("steps_s"),
        "index_steps_s": built.get("index_steps_s"),
        "machine_at_build": built.get("machine"),
        "load_s": round(load_s, 2),
        "nprobe": built["nprobe"],
        "store": built.get("store"),
        "rerank": built.get("rerank"),
        "hybrid_weight": weight,
        "blas_threads": args.blas_threads,
        "task_hit_at_1_real": round(real_task_hit_at_1(src, weight), 4),
        "task_hit_at_1_synthetic": round(synthetic_hit, 4),
        "index_gb": {m: round(index_bytes(e.index) / 1e9, 3) for m, e in state.embedders.items()},
        "index_nprobe_rerank": {m: [e.index.nprobe, e.index.rerank] for m, e in state.embedders.items()},
        "input_gram": gram,
        "synthetic": True,
    }


def serve_input_gram(
    src: Source, args: argparse.Namespace, engine: object, sessions: object, space: str, queries: np.ndarray, shards: np.ndarray
) -> dict[str, object]:
    """input_gram search's latency and recall@10 against the exhaustive input-Gram ranking, with the first stage served
    (EXACT_CANDIDATES) and, on the same queries, with the module sketch's candidates alone (the baseline: before the
    input-Gram index) and the input-Gram sketch's alone."""
    import embed.serving.search_methods as methods_module
    from embed.serving.results import Query
    from embed.serving.search_methods import GRAM, SKETCH

    def one(i: int, filters: dict[str, str] | None = None) -> tuple[float, list[int]]:
        with sessions() as session:  # type: ignore[operator]
            t = time.perf_counter()
            found = engine.similar(session, space, Query(f"syn-{i:07d}", int(i)), 10, filters, method="input_gram")  # type: ignore[attr-defined]
            return time.perf_counter() - t, [r["adapter_id"] for r in found["results"]]

    rq = queries[: args.recall_queries]
    exact, _, exhaustive_s = exhaustive_gram_top(src, args.adapters, args.seed, rq, 10)
    exact_f, _, _ = exhaustive_gram_top(src, args.adapters, args.seed, rq, 10, shards[: len(rq)])
    served = dict(methods_module.EXACT_CANDIDATES)
    out: dict[str, object] = {"exhaustive_ms_per_query": round(exhaustive_s * 1e3, 1), "candidates": list(served["input_gram"])}
    for name, first in (("served", served["input_gram"]), ("module_sketch_only", (SKETCH,)), ("input_gram_sketch_only", (GRAM,))):
        methods_module.EXACT_CANDIDATES = {**served, "input_gram": first}
        try:
            for i in queries[:20]:  # warm-up
                one(int(i))
            single = [one(int(i)) for i in queries]
            filtered = [one(int(i), {"shard": f"s{int(j)}"}) for i, j in zip(queries, shards, strict=True)]
        finally:
            methods_module.EXACT_CANDIDATES = served
        p50, p99 = percentiles([t for t, _ in single])
        f50, f99 = percentiles([t for t, _ in filtered])
        recall = float(np.mean([len(set(single[j][1]) & set(exact[j].tolist())) / 10 for j in range(len(rq))]))
        recall_f = float(np.mean([len(set(filtered[j][1]) & set(exact_f[j].tolist())) / 10 for j in range(len(rq))]))
        out[name] = {
            "p50_ms": round(p50, 3),
            "p99_ms": round(p99, 3),
            "p50_ms_filtered_1pct": round(f50, 3),
            "p99_ms_filtered_1pct": round(f99, 3),
            "recall_at_10": round(recall, 4),
            "recall_at_10_filtered_1pct": round(recall_f, 4),
        }
    base, now = out["module_sketch_only"], out["served"]
    out["recall_ratio_to_module_sketch_only"] = round(now["recall_at_10"] / max(base["recall_at_10"], 1e-12), 3)  # type: ignore[index]
    out["p99_ratio_to_module_sketch_only"] = round(now["p99_ms"] / max(base["p99_ms"], 1e-12), 3)  # type: ignore[index]
    return out


if __name__ == "__main__":
    main()
