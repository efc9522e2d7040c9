"""Benchmark: `zoo embed`'s CPU seconds (relation step included) at real sizes, two versions of the code alternated on
the same ingested adapters.

Adapters are written by `zoo.reference.real_shapes` (`bench.realsize`'s writer: --layers blocks, families of 4) and
ingested with `--no-embed` once per size into WORK/base/KIND-N (kept: a later run reuses them). Each run copies one of
those data dirs to WORK/scratch and runs `python -m zoo.cli embed --space BASE --json` in a child whose working
directory is one of --trees (a checkout: its packages come first on sys.path), and counts the child's user + system
CPU seconds (wall time is noisy on a shared machine). Rounds alternate the trees' order. After each run the results
are digested (every vector, the edges and scans, the module store's and the map's tensors) and must be equal for
every tree. Prints each run as JSON and, per tree, the CPU seconds an adapter past the smallest size, and the ratio.

    python -m bench.embed_cpu --work W --kind llama3-8b --trees OLD_CHECKOUT NEW_CHECKOUT --rounds 2
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import resource
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from zoo.reference.real_shapes import MODELS, write_zoo

MEMBERS = 4


def base_dir(work: Path, kind: str, n: int, layers: int) -> Path:
    """WORK/base/KIND-N: n adapters of `kind` ingested without embedding (made the first time)."""
    data = work / "base" / f"{kind}-{n}"
    if (data / "zoo.db").exists():
        return data
    files = work / "files" / f"{kind}-{n}"
    shutil.rmtree(files, ignore_errors=True)
    shutil.rmtree(data, ignore_errors=True)
    written = write_zoo(kind, files, n // MEMBERS, MEMBERS, layers)
    with (files / "labels.csv").open("w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(["name", "task"])
        out.writerows([p.name, f"f{family}"] for p, family in written)
    env = {**os.environ, "ZOO_DATA_DIR": str(data)}
    env.pop("ZOO_DATABASE_URL", None)
    zoo = [sys.executable, "-m", "zoo.cli"]
    subprocess.run([*zoo, "init"], env=env, check=True, capture_output=True)
    cmd = [*zoo, "ingest", "--no-embed", str(files), "--base-model", MODELS[kind].base_model, "--labels", str(files / "labels.csv")]
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return data


def digest(data: Path) -> dict[str, object]:
    """Digests of what `zoo embed` wrote: vectors, edges, scans, and the module store's and map's tensors."""
    from safetensors.numpy import load_file

    db = sqlite3.connect(data / "zoo.db")
    h = hashlib.sha256()
    for adapter, embedder, vector in db.execute("select adapter_id, embedder_id, vector from embedding order by 1, 2"):
        h.update(f"{adapter}:{embedder}".encode())
        h.update(vector)
    edges = db.execute(
        "select child_id, parent_id, relation, parameters, evidence, confidence from adapter_relation order by 1, 2, 3"
    ).fetchall()
    scans = db.execute("select adapter_id, detector, space_version, error from relation_scan order by 1").fetchall()
    out: dict[str, object] = {
        "vectors": h.hexdigest()[:16],
        "edges": len(edges),
        "edges_digest": hashlib.sha256(repr(edges).encode()).hexdigest()[:16],
        "scans_digest": hashlib.sha256(repr(scans).encode()).hexdigest()[:16],
    }
    db.close()
    for path in sorted([*(data / "rerank").glob("*.safetensors"), *(data / "map").glob("*.safetensors")]):
        tensors = load_file(path)
        t = hashlib.sha256()
        for name in sorted(tensors):
            t.update(name.encode())
            t.update(tensors[name].tobytes())
        out[f"{path.parent.name}/{path.name}"] = t.hexdigest()[:16]
    return out


def run(tree: Path, base: Path, scratch: Path, space: str) -> tuple[float, float, dict[str, object]]:
    """(CPU seconds, wall seconds, digest) of one `zoo embed` with the code of `tree` on a copy of `base`."""
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(base, scratch)
    env = {**os.environ, "ZOO_DATA_DIR": str(scratch)}
    env.pop("ZOO_DATABASE_URL", None)
    env.pop("PYTHONPATH", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "zoo.cli", "embed", "--space", space, "--json"], cwd=tree, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        sys.exit(f"zoo embed failed in {tree}:\n{proc.stderr[-3000:]}")
    found = digest(scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), wall, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="working dir (ingested data dirs are kept in WORK/base)")
    parser.add_argument("--trees", type=Path, nargs="+", required=True, help="checkouts of the code to compare")
    parser.add_argument("--kind", default="llama3-8b", help=f"one of {', '.join(MODELS)}")
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[12, 48], help=f"adapters per data dir, multiples of {MEMBERS} (default 12 48)"
    )
    parser.add_argument("--layers", type=int, default=4, help="blocks kept (default 4)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if any(n % MEMBERS or n <= 0 for n in args.sizes):
        parser.error(f"--sizes: multiples of {MEMBERS} (families of {MEMBERS})")
    bases = {n: base_dir(args.work, args.kind, n, args.layers) for n in args.sizes}
    space = MODELS[args.kind].base_model
    cpu: dict[tuple[str, int], list[float]] = {}
    seen: dict[int, dict[str, object]] = {}
    for rnd in range(args.rounds):
        trees = args.trees if rnd % 2 == 0 else list(reversed(args.trees))
        for n in args.sizes:
            for tree in trees:
                seconds, wall, found = run(tree.resolve(), bases[n], args.work / "scratch" / f"{tree.name}-{n}", space)
                cpu.setdefault((str(tree), n), []).append(seconds)
                same = seen.setdefault(n, found) == found
                row = {"round": rnd, "tree": str(tree), "adapters": n, "cpu_s": round(seconds, 2), "wall_s": round(wall, 1)}
                print(json.dumps({**row, "load": round(os.getloadavg()[0], 1), "same_results": same, **found}), flush=True)
    first, last = min(args.sizes), max(args.sizes)
    per = {}
    for tree in args.trees:
        a, b = (sum(cpu[(str(tree), n)]) / len(cpu[(str(tree), n)]) for n in (first, last))
        per[str(tree)] = (b - a) / max(last - first, 1)
        print(f"{tree}: {first}: {a:.1f} CPU s, {last}: {b:.1f} CPU s, {per[str(tree)]:.3f} CPU s an adapter past the first {first}")
    if len(args.trees) == 2:
        print(f"ratio {args.trees[1]} / {args.trees[0]} an adapter: {per[str(args.trees[1])] / per[str(args.trees[0])]:.3f}")


if __name__ == "__main__":
    main()
