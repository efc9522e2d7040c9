"""Benchmark: the zoo map's fit + projection (embed/serving/projection.py) at real sizes, against the exact covariance
route it replaced (d × d float64 covariance + eigh) measured in the same run.

Sizes (n vectors × d dimensions): 50,000 × 2,048 (a bounded search vector, MAX_FIT vectors) and 2,000 × 63,296
(SDXL's unbounded sketch, where the covariance is 29.8 GiB). Vectors are unit rows of a few hundred families in a
64-dimensional latent space with decaying scales, plus noise (`--kind families`); `--kind clusters` is the hard
case for the iteration: 50 random centres, so the top eigenvalues are close together.

Each route runs in a fresh process: time of fit + projection of all n vectors, and its peak RSS above the process
after the data were made (VmHWM, reset through /proc/self/clear_refs). Routes: `lanczos` (the library's `fit`),
`covariance` (the old route, skipped where 2·d²·8 bytes exceed the memory available), `gram` (the n × n route
for n < d, for the choice: skipped where n² is large). Agreement: the cosines of the axes with the old (or Gram)
route's. Prints a line per size and, on the last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import embed.serving.projection as P

SIZES = ((50_000, 2_048), (2_000, 63_296))


def make(n: int, d: int, kind: str, seed: int = 0) -> np.ndarray:
    """(n, d) float32 unit rows, made 4,096 rows at a time (see the module doc for the kinds)."""
    rng = np.random.default_rng(seed)
    if kind == "families":
        latent = rng.standard_normal((300, 64)) * np.geomspace(1.0, 0.05, 64)
        lift = rng.standard_normal((64, d)) / np.sqrt(64)
    else:
        latent, lift = rng.standard_normal((50, d)), None
    out = np.empty((n, d), np.float32)
    for start in range(0, n, 4096):
        rows = min(4096, n - start)
        centre = latent[rng.integers(0, len(latent), rows)]
        x = (centre + 0.2 * rng.standard_normal(centre.shape) * centre.std()) @ lift if kind == "families" else centre
        x = x + (0.3 if kind == "families" else 0.5) * rng.standard_normal((rows, d)) / np.sqrt(d) * np.linalg.norm(x, axis=1).mean()
        out[start : start + rows] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def covariance_fit(ids: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """The basis of the route it replaced: a d × d float64 covariance, accumulated in chunks, and eigh."""
    sample = vectors[P.spread_sample(ids, P.MAX_FIT)]
    mean = sample.mean(axis=0, dtype=np.float64)
    d = sample.shape[1]
    cov = np.zeros((d, d))
    for start in range(0, len(sample), 4096):
        x = sample[start : start + 4096].astype(np.float64) - mean
        cov += x.T @ x
    _, vecs = np.linalg.eigh(cov)
    basis = vecs[:, ::-1][:, :2].T
    P.Projection(mean.astype(np.float32), basis.astype(np.float32), (0.0, 0.0)).project(vectors)
    return basis


def gram_fit(ids: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """The n × n route: G = X Xᵀ of the centred sample (columns in chunks), eigh, axes Xᵀu/σ."""
    sample = vectors[P.spread_sample(ids, P.MAX_FIT)]
    mean = sample.mean(axis=0, dtype=np.float64)
    n, d = sample.shape
    gram = np.zeros((n, n))
    step = max(1, P.CHUNK_BYTES // (8 * n))
    for start in range(0, d, step):
        x = sample[:, start : start + step].astype(np.float64) - mean[start : start + step]
        gram += x @ x.T
    values, u = np.linalg.eigh(gram)
    u, values = u[:, ::-1][:, :2], values[::-1][:2]
    basis = np.zeros((2, d))
    for start, x in P.centred_chunks(sample, mean):
        basis += (x.T @ u[start : start + len(x)]).T
    basis /= np.sqrt(values)[:, None]
    P.Projection(mean.astype(np.float32), basis.astype(np.float32), (0.0, 0.0)).project(vectors)
    return basis


def lanczos_fit(ids: np.ndarray, vectors: np.ndarray) -> tuple[np.ndarray, int]:
    """The library's fit and projection; (basis, passes over the sample)."""
    passes = [0]
    times = P.times_covariance

    def counted(*args: np.ndarray, **kwargs: bool) -> tuple[np.ndarray, float]:
        passes[0] += 1
        return times(*args, **kwargs)

    P.times_covariance = counted  # type: ignore[assignment]
    try:
        p = P.fit(ids, vectors)
        p.project(vectors)
    finally:
        P.times_covariance = times  # type: ignore[assignment]
    return p.basis, passes[0]


def _status(key: str) -> int:
    """A /proc/self/status figure in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(route: str, n: int, d: int, kind: str, out: Path) -> None:
    """Run one route in this (fresh) process and print {seconds, peak_rss_bytes, passes}."""
    vectors = make(n, d, kind)
    ids = np.arange(1, n + 1, dtype=np.int64)
    base = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from here
    t0 = time.perf_counter()
    passes = 0
    if route == "lanczos":
        basis, passes = lanczos_fit(ids, vectors)
    else:
        basis = covariance_fit(ids, vectors) if route == "covariance" else gram_fit(ids, vectors)
    seconds = time.perf_counter() - t0
    np.save(out / f"{route}.npy", np.asarray(basis, np.float64))
    print(json.dumps({"seconds": round(seconds, 2), "peak_rss_bytes": _status("VmHWM") - base, "passes": passes}))


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def run_route(route: str, n: int, d: int, kind: str, out: Path) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "bench.map", "--child", route, str(n), str(d), kind, str(out)], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=("families", "clusters"), default="families")
    p.add_argument("--sizes", type=int, nargs="+", help="n d n d ... (default: 50000 2048 2000 63296)")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        route, n, d, kind, out = args.child
        child(route, int(n), int(d), kind, Path(out))
        return
    sizes = list(zip(args.sizes[::2], args.sizes[1::2], strict=True)) if args.sizes else SIZES
    result: dict[str, object] = {"kind": args.kind, "memory_available_gib": round(available_bytes() / 2**30, 1), "cpus": os.cpu_count()}
    for n, d in sizes:
        row: dict[str, object] = {}
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            row["lanczos"] = run_route("lanczos", n, d, args.kind, out)
            for route, need in (("covariance", 2 * d * d * 8), ("gram", 2 * n * n * 8)):
                if route == "gram" and n >= d:
                    row[route] = {"skipped": "n ≥ d"}
                elif need < available_bytes() // 2:
                    row[route] = run_route(route, n, d, args.kind, out)
                else:
                    row[route] = {"skipped": f"needs {need / 2**30:.1f} GiB"}
            new = np.load(out / "lanczos.npy")
            for route in ("covariance", "gram"):
                if (out / f"{route}.npy").exists():
                    cosines = np.abs(np.sum(new * np.load(out / f"{route}.npy"), axis=1))
                    row[f"cos_vs_{route}"] = [round(float(c), 9) for c in cosines]
        lan, cov = row["lanczos"], row["covariance"]
        if "seconds" in cov:  # type: ignore[operator]
            row["speedup_vs_covariance"] = round(cov["seconds"] / lan["seconds"], 2)  # type: ignore[index]
            row["rss_ratio_vs_covariance"] = round(cov["peak_rss_bytes"] / lan["peak_rss_bytes"], 2)  # type: ignore[index]
        result[f"{n}x{d}"] = row
        shown = ", ".join(
            f"{route} {r['seconds']} s / {r['peak_rss_bytes'] / 2**20:.0f} MiB" if "seconds" in r else f"{route} {r['skipped']}"
            for route, r in ((k, row[k]) for k in ("lanczos", "covariance", "gram"))  # type: ignore[misc]
        )
        print(f"n={n} d={d}: {shown}; lanczos passes {lan['passes']}")  # type: ignore[index]
    result["load_average"] = [round(x, 1) for x in os.getloadavg()]  # other work on the machine slows BLAS
    print(json.dumps(result))


if __name__ == "__main__":
    main()
