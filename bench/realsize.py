"""Benchmark: adapters at the real shapes of the models users adapt, end to end through `zoo`.

Writes families of adapters with `zoo.reference.real_shapes` (Llama-3-8B r16 PEFT and SDXL r8 kohya by
default: --kinds), then, each step a `zoo` command in a child process whose wall time and peak RSS
(its own, from wait4) are measured:

- ingest, one worker process per kind: MB/s of adapter file (the command's wall time, and the stages' sum
  without the process's start), and the ratio of that time to `safetensors.torch.load_file` of the same files
  (the floor: reading the tensors once) measured here;
- `zoo embed` per space: adapters/s and peak RSS, and its relation step's ms per adapter and edges found; how much of
  the space's blobs the page cache held at its start (`fincore`: the ingest of the next kind passes its files and blobs
  through the cache, so a whole-model run reads part of them from disk), and the same `zoo embed` again on a copy of the
  data dir as it was before (the blobs hard-linked and read through first, so that the cache holds what memory
  allows): the figure from memory, and the ratio; every space's search vector dimensions;
- same-family hit@1: each adapter's nearest other adapter (`zoo search ID -k 1`, in-process through the
  query engine) is of its family, by module cosine, and after training by the default (hybrid) search;
- `zoo train` on the first kind's space (--skip-train to leave it out): time and peak RSS;
- a full-checkpoint pair at TinyLlama-1.1B's shape, bf16 (`zoo.reference.real_checkpoints`),
  ingested as a delta with `--base` (--skip-checkpoint to leave it out): time and peak RSS.

    python -m bench.realsize                              # 100 + 100 adapters, whole models (~15 GB of files)
    python -m bench.realsize --adapters 20 --layers 4      # a quick run

Prints a table and, on the last line, one JSON object with the figures and the issue's goals.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zoo.reference.real_shapes import MODELS, write_zoo

GOALS = {
    "ingest_mb_per_s": 50.0,
    "embed_peak_rss_gb": 2.0,
    "embed_adapters_per_s": 5.0,
    "search_dim": 2048,
    "train_minutes": 15.0,
    "train_peak_rss_gb": 6.0,
    "family_hit_at_1": 0.95,
    "checkpoint_peak_rss_gb": 3.0,
}


def measured(args: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(seconds, peak RSS in GB, stdout) of one command, through a fresh wrapper process so that the peak RSS is
    this command's alone; exits on failure."""
    wrapper = (
        "import json, resource, subprocess, sys, time\n"
        "t0 = time.perf_counter()\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "sys.stdout.write(p.stdout)\n"
        "sys.stderr.write(p.stderr)\n"
        "print(json.dumps({'seconds': time.perf_counter() - t0, 'maxrss_kb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,"
        " 'rc': p.returncode}), file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", wrapper, *args], env=env, capture_output=True, text=True)
    stats = json.loads(proc.stderr.strip().splitlines()[-1])
    if stats["rc"] != 0:
        sys.exit(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return float(stats["seconds"]), stats["maxrss_kb"] / 2**20, proc.stdout


def weight_files(path: Path) -> list[Path]:
    return sorted(path.rglob("*.safetensors"))


def load_file_seconds(files: list[Path]) -> float:
    """Seconds safetensors.torch.load_file takes for the files, in a child (cold to this process's allocator)."""
    code = (
        "import sys, time\nfrom safetensors.torch import load_file\nt = time.perf_counter()\n"
        "for f in sys.argv[1:]:\n    load_file(f)\nprint(time.perf_counter() - t)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *map(str, files)], capture_output=True, text=True, check=True).stdout
    return float(out.strip())


def family_hit_at_1(data_dir: Path, base_model: str, families: dict[int, int], method: str | None) -> float:
    """Share of adapters whose nearest other adapter (by `method`, the space's default if None) is of their family."""
    from embed.serving.engine import QueryEngine
    from embed.serving.results import Query
    from zoo.config import Settings
    from zoo.store.blobs import BlobStore
    from zoo.store.session import session_factory

    settings = Settings.load()
    sessions = session_factory(settings.database_url)
    engine = QueryEngine(sessions, BlobStore(settings.blob_dir), data_dir)
    hits = 0
    with sessions() as session:
        from embed.serving.resources import resolve_space

        space = resolve_space(session, base_model).name
        for adapter_id, family in families.items():
            result = engine.similar(session, space, Query(str(adapter_id), adapter_id=adapter_id), 1, method=method)
            top = result["results"][0]["adapter_id"] if result["results"] else None  # type: ignore[index]
            hits += families.get(int(top), -1) == family if top is not None else 0
    return hits / max(len(families), 1)


def stored_families(data_dir: Path, base_model: str) -> dict[int, int]:
    """adapter id -> family of the stored adapters of a base model (from their `task` label, f<family>)."""
    from sqlalchemy import select

    from zoo.config import Settings
    from zoo.store.models import Adapter, Label
    from zoo.store.session import session_factory

    with session_factory(Settings.load().database_url)() as session:
        rows = session.execute(
            select(Adapter.id, Label.value)
            .join(Label, Label.adapter_id == Adapter.id)
            .where(Adapter.base_model == base_model, Label.key == "task")
        ).all()
    return {int(i): int(v[1:]) for i, v in rows}


def blob_files(data_dir: Path, base_model: str) -> list[Path]:
    """The blob files of the canonical factors of a base model's stored adapters."""
    from sqlalchemy import select

    from zoo.config import Settings
    from zoo.store.blobs import BlobStore
    from zoo.store.models import Adapter
    from zoo.store.session import session_factory

    settings = Settings.load()
    with session_factory(settings.database_url)() as session:
        digests = session.scalars(select(Adapter.factors_blob).where(Adapter.base_model == base_model, Adapter.factors_blob.is_not(None)))
        return BlobStore(settings.blob_dir).local_files(sorted({str(d) for d in digests}))


def cached_share(files: list[Path]) -> float | None:
    """The share of these files' bytes in the page cache (util-linux `fincore`), None where it cannot be read."""
    if not files or shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return sum(int(v) for v in out.stdout.split()) / max(sum(f.stat().st_size for f in files), 1)


def sqlite_copy(source: Path, target: Path) -> None:
    """A consistent copy of a SQLite database, its write-ahead log included (SQLite's backup)."""
    import sqlite3

    with sqlite3.connect(source) as a, sqlite3.connect(target) as b:
        a.backup(b)
    a.close()
    b.close()


def read_through(files: list[Path]) -> None:
    """Read the files whole, so that the page cache holds them where memory allows."""
    buffer = bytearray(8 << 20)
    for path in files:
        with path.open("rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def embed_again(data_dir: Path, before: Path, base_model: str, env: dict[str, str]) -> tuple[float, float, float | None]:
    """(seconds, peak RSS in GB, the share of its blobs in the page cache at its start) of `zoo embed` of the space once
    more, on a copy of the data dir as it was before its first embed (the database `before`, the blobs hard-linked),
    its blobs read through first: the figure from memory."""
    copy = data_dir.parent / "embed-again"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(data_dir / "blobs", copy / "blobs", copy_function=os.link)
    sqlite_copy(before, copy / "zoo.db")
    files = blob_files(data_dir, base_model)
    read_through(files)
    cached = cached_share(files)
    command = [sys.executable, "-m", "zoo.cli", "embed", "--space", base_model, "--json"]
    try:
        seconds, rss, _ = measured(command, {**env, "ZOO_DATA_DIR": str(copy)})
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    return seconds, rss, cached


def search_dims(data_dir: Path) -> dict[str, dict[str, int]]:
    """Per space, the dimension of each serving embedder's vectors."""
    from sqlalchemy import select

    from zoo.config import Settings
    from zoo.store.embedders import serving_embedders
    from zoo.store.models import EmbeddingSpace
    from zoo.store.session import session_factory

    with session_factory(Settings.load().database_url)() as session:
        return {
            s.base_model: {m: int(e.dim) for m, e in serving_embedders(session, s.id).items()}
            for s in session.scalars(select(EmbeddingSpace).order_by(EmbeddingSpace.name))
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="llama3-8b,sdxl", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--adapters", type=int, default=100, help="adapters per kind (default 100)")
    parser.add_argument("--families", type=int, default=10)
    parser.add_argument("--layers", type=int, default=None, help="keep the first N blocks (default: whole models)")
    parser.add_argument("--work", type=Path, default=None, help="working dir (default: a temp dir, removed after)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--members", type=int, default=2)
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--skip-checkpoint", action="store_true")
    parser.add_argument("--checkpoint-layers", type=int, default=None, help="TinyLlama layers (default: all 22)")
    args = parser.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    work = args.work or Path(tempfile.mkdtemp(prefix="zoo-realsize-"))
    data_dir = work / "data"
    env = {**os.environ, "ZOO_DATA_DIR": str(data_dir)}
    env.pop("ZOO_DATABASE_URL", None)
    os.environ.update(ZOO_DATA_DIR=str(data_dir))
    os.environ.pop("ZOO_DATABASE_URL", None)
    zoo = [sys.executable, "-m", "zoo.cli"]
    figures: dict[str, object] = {"kinds": kinds, "adapters_per_kind": args.adapters, "families": args.families, "layers": args.layers}
    rows: list[tuple[str, str]] = []
    try:
        subprocess.run([*zoo, "init"], env=env, check=True, capture_output=True)
        members = max(1, args.adapters // args.families)
        for kind in kinds:
            model = MODELS[kind]
            directory = work / "files" / kind
            t0 = time.perf_counter()
            written = write_zoo(kind, directory, args.families, members, args.layers)
            write_s = time.perf_counter() - t0
            labels = directory / "labels.csv"
            with labels.open("w", newline="") as fh:
                out = csv.writer(fh)
                out.writerow(["name", "task"])
                out.writerows([p.name, f"f{family}"] for p, family in written)
            files = weight_files(directory)
            mb = sum(f.stat().st_size for f in files) / 1e6
            seconds, rss, out = measured(
                [*zoo, "ingest", "--no-embed", str(directory), "--base-model", model.base_model, "--labels", str(labels), "--json"], env
            )
            items = [json.loads(line) for line in out.splitlines() if line.startswith("{") and '"timings"' in line]
            in_items = sum(sum(r["timings"].values()) for r in items)
            floor = load_file_seconds(files)
            figures[kind] = {
                "modules": len(model.modules(args.layers)),
                "file_mb": round(mb / len(files), 1),
                "write_seconds": round(write_s, 1),
                "ingest_mb_per_s": round(mb / seconds, 1),
                "ingest_mb_per_s_in_ingest": round(mb / max(in_items, 1e-9), 1),
                "ingest_vs_load_file": round(seconds / floor, 2),
                "ingest_peak_rss_gb": round(rss, 2),
            }
            text = f"{mb / seconds:.1f} MB/s ({mb / in_items:.1f} in the ingest stages; {len(files)} files of {mb / len(files):.1f} MB)"
            text += f", {seconds / floor:.1f}× load_file"
            rows.append((f"ingest {kind}", f"{text}, RSS {rss:.2f} GB"))
        embed_rss = 0.0
        for kind in kinds:
            base = MODELS[kind].base_model
            cached = cached_share(blob_files(data_dir, base))
            before = work / "zoo.db.before-embed"
            sqlite_copy(data_dir / "zoo.db", before)
            seconds, rss, printed = measured([*zoo, "embed", "--space", base, "--json"], env)
            embed_rss = max(embed_rss, rss)
            n = len(stored_families(data_dir, base))
            step = json.loads(printed)[0]["relations"]
            again, again_rss, again_cached = embed_again(data_dir, before, base, env)
            before.unlink()
            figures[kind]["embed_adapters_per_s"] = round(n / seconds, 2)  # type: ignore[index]
            figures[kind]["embed_blobs_cached_share"] = None if cached is None else round(cached, 3)  # type: ignore[index]
            figures[kind]["embed_again_adapters_per_s"] = round(n / again, 2)  # type: ignore[index]
            figures[kind]["embed_again_blobs_cached_share"] = None if again_cached is None else round(again_cached, 3)  # type: ignore[index]
            figures[kind]["embed_peak_rss_gb"] = round(max(rss, again_rss), 2)  # type: ignore[index]
            figures[kind]["relation_ms_per_adapter"] = round(step["ms_per_adapter"] or 0.0, 1)  # type: ignore[index]
            figures[kind]["relation_edges"] = step["edges"]  # type: ignore[index]
            hit = family_hit_at_1(data_dir, base, stored_families(data_dir, base), "module")
            figures[kind]["family_hit_at_1_module"] = round(hit, 3)  # type: ignore[index]
            share, again_share = ("" if c is None else f" ({c:.0%} of its blobs in the page cache)" for c in (cached, again_cached))
            text = f"{n / seconds:.2f} adapters/s{share}; again, its blobs read first, {n / again:.2f}/s{again_share}"
            text += f" ({seconds / again:.2f}×)"
            text += f", RSS {rss:.2f} / {again_rss:.2f} GB, same-family hit@1 {hit:.3f} (module cosine)"
            text += f"; relation step {step['ms_per_adapter'] or 0.0:.0f} ms an adapter, {step['edges']} edges"
            rows.append((f"embed {kind}", text))
        figures["embed_peak_rss_gb"] = round(embed_rss, 2)
        dims = search_dims(data_dir)
        figures["search_dims"] = dims
        figures["max_search_dim"] = max((d for e in dims.values() for d in e.values()), default=0)
        rows.append(("search dims", json.dumps(dims)))
        if not args.skip_train:
            kind = kinds[0]
            base = MODELS[kind].base_model
            cmd = [*zoo, "train", "--space", base, "--epochs", str(args.epochs), "--members", str(args.members), "--json"]
            seconds, rss, _ = measured(cmd, env)
            hit = family_hit_at_1(data_dir, base, stored_families(data_dir, base), None)
            figures["train"] = {
                "kind": kind,
                "minutes": round(seconds / 60, 2),
                "peak_rss_gb": round(rss, 2),
                "family_hit_at_1": round(hit, 3),
            }
            rows.append((f"train {kind}", f"{seconds / 60:.1f} min, RSS {rss:.2f} GB, same-family hit@1 {hit:.3f} (default search)"))
        if not args.skip_checkpoint:
            from zoo.reference.real_checkpoints import write_checkpoint_pair

            base_ckpt, tuned = write_checkpoint_pair(work / "checkpoint", layers=args.checkpoint_layers)
            seconds, rss, _ = measured([*zoo, "ingest", "--no-embed", str(tuned), "--base", str(base_ckpt), "--json"], env)
            figures["checkpoint"] = {"seconds": round(seconds, 1), "peak_rss_gb": round(rss, 2), "layers": args.checkpoint_layers or 22}
            rows.append(("checkpoint 1.1B delta", f"{seconds:.1f} s, RSS {rss:.2f} GB"))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    for name, text in rows:
        print(f"{name:<24} {text}")
    figures["goals"] = GOALS
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
