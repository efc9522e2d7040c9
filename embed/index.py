"""FAISS index of one embedder: ids are adapter ids, scores are cosine similarities.

Design around FAISS's limits:
- vectors are L2-normalized, so inner product = cosine;
- below `IVF_FROM` vectors the index is exact (`IndexIDMap2` over `IndexFlatIP`); from there
  on it is an inverted file over float16 codes (`IndexIVFScalarQuantizer`, half the memory of
  float32, cosine error ~1e-3) whose `nprobe` is the smallest that puts `RECALL_GOAL` of the
  exact top 10 among its `CANDIDATES` nearest, measured on a sample of its own vectors when it is
  built (the engine re-ranks those candidates by their stored vectors);
- both keep every vector reachable by id (`vectors`), so re-ranking and filtered search read
  the stored vectors and never re-embed;
- GPU indexes are not thread-safe: a GPU copy of an exact index is searched under a lock;
  CPU searches run concurrently, writes take the lock;
- files are written atomically (temporary file + rename) with a sidecar: the embedder, the
  count, and the space version the index was written at. A reader compares it with the
  database's version without reading any vector (see embed/engine.py).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path

import faiss
import numpy as np

IVF_FROM = 100_000
#: the first stage hands this many candidates to the exact re-ranking
CANDIDATES = 200
#: an IVF index's nprobe is the smallest that puts this share of the exact top 10 among its CANDIDATES
RECALL_GOAL = 0.97
NPROBES = (4, 8, 16, 32, 64, 128, 256)


def ivf_lists(n: int) -> int:
    """Inverted lists for n vectors: 2·√n (2,000 at a million: 500 vectors a list), at most n / 39 so
    that k-means has 39 points a list."""
    return int(min(max(16, 2 * np.sqrt(n)), max(1, n // 39)))


def normalize(vectors: np.ndarray) -> np.ndarray:
    v = np.ascontiguousarray(vectors, dtype=np.float32)
    if v.ndim == 1:
        v = v[None, :]
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    return v / np.maximum(norms, 1e-12)


def gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


class AdapterIndex:
    """One embedder's vectors, searchable by cosine and readable by adapter id."""

    def __init__(self, index: faiss.Index, dim: int) -> None:
        self.index = index
        self.dim = dim
        self._lock = threading.Lock()
        self._gpu: faiss.Index | None = None

    @classmethod
    def exact(cls, dim: int) -> AdapterIndex:
        return cls(faiss.IndexIDMap2(faiss.IndexFlatIP(dim)), dim)

    @classmethod
    def build(cls, ids: np.ndarray, vectors: np.ndarray, ivf: bool | None = None) -> AdapterIndex:
        """An index over (ids, vectors): exact below IVF_FROM vectors, IVF above (unless told)."""
        vectors = normalize(vectors) if len(ids) else np.zeros((0, np.asarray(vectors).shape[1]), np.float32)
        dim = int(vectors.shape[1])
        if ivf is None:
            ivf = len(ids) >= IVF_FROM
        if not ivf:
            index = cls.exact(dim)
            index.add(ids, vectors)
            return index
        rng = np.random.default_rng(0)
        obj = cls.trained_ivf(vectors[rng.choice(len(vectors), size=min(len(vectors), 64 * ivf_lists(len(ids))), replace=False)], len(ids))
        obj.add(ids, vectors)
        obj.tune_nprobe(vectors[rng.choice(len(vectors), size=min(len(vectors), 200), replace=False)])
        return obj

    @classmethod
    def trained_ivf(cls, sample: np.ndarray, expected: int) -> AdapterIndex:
        """An empty IVF index for about `expected` vectors, its coarse quantizer trained on `sample`
        (add the vectors, then `tune_nprobe`)."""
        sample = normalize(sample)
        dim = int(sample.shape[1])
        quantizer = faiss.IndexFlatIP(dim)
        fp16, inner_product = faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT
        index = faiss.IndexIVFScalarQuantizer(quantizer, dim, ivf_lists(expected), fp16, inner_product)
        index.train(sample)
        index.set_direct_map_type(faiss.DirectMap.Hashtable)
        return cls(index, dim)

    @property
    def kind(self) -> str:
        return "ivf" if self.ivf else "flat"

    @property
    def ivf(self) -> bool:
        return isinstance(self.index, faiss.IndexIVF)

    @property
    def nprobe(self) -> int | None:
        return int(self.index.nprobe) if self.ivf else None

    @property
    def size(self) -> int:
        return int(self.index.ntotal)

    def tune_nprobe(self, queries: np.ndarray, k: int = 10, candidates: int = CANDIDATES) -> float:
        """Set nprobe to the smallest in NPROBES whose `candidates` nearest hold RECALL_GOAL of the exact
        top k (what re-ranking the candidates by stored vectors then serves); returns that recall."""
        queries = normalize(queries)
        ivf = faiss.extract_index_ivf(self.index)
        ivf.nprobe = ivf.nlist
        _, exact = self.index.search(queries, k)
        recall = 1.0
        for nprobe in [p for p in NPROBES if p < ivf.nlist] + [ivf.nlist]:
            ivf.nprobe = nprobe
            found = self.index.search(queries, candidates)[1]
            recall = float(np.mean([len(set(e.tolist()) & set(f.tolist())) / k for e, f in zip(exact, found, strict=True)]))
            if recall >= RECALL_GOAL:
                break
        return recall

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if not len(ids):
            return
        vectors = normalize(vectors)
        if vectors.shape != (len(ids), self.dim):
            raise ValueError(f"expected {len(ids)} vectors of dimension {self.dim}, got {vectors.shape}")
        with self._lock:
            present = [int(i) for i in ids[: min(len(ids), 10_000)] if self.contains(int(i))]
            if present:
                raise ValueError(f"ids already in the index: {present[:5]}")
            self.index.add_with_ids(vectors, ids)
            self._gpu = None

    def contains(self, adapter_id: int) -> bool:
        try:
            self.index.reconstruct(adapter_id)
        except RuntimeError:
            return False
        return True

    def remove(self, ids: np.ndarray) -> int:
        with self._lock:
            removed = int(self.index.remove_ids(np.ascontiguousarray(ids, dtype=np.int64)))
            self._gpu = None
            return removed

    def upsert(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Add vectors, replacing those of ids already present (a re-embedded adapter)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        old = np.array([i for i in ids.tolist() if self.contains(i)], dtype=np.int64)
        if len(old):
            self.remove(old)
        self.add(ids, vectors)

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        """(len(ids), dim) stored unit vectors of these adapter ids (KeyError for one not in the index)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if not len(ids):
            return np.zeros((0, self.dim), np.float32)
        try:
            return self.index.reconstruct_batch(ids)
        except RuntimeError as exc:
            missing = [int(i) for i in ids.tolist() if not self.contains(int(i))]
            raise KeyError(f"adapters not in the index: {missing[:5]}") from exc

    def search(self, queries: np.ndarray, k: int, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) of the k nearest by cosine, best first; id -1 pads when fewer exist.
        `allowed`: only these adapter ids (a FAISS id selector; an IVF index probes nprobe / share of
        the zoo allowed lists, all of them for a small share, where the search is exact)."""
        q = normalize(queries)
        k = max(1, min(k, self.size)) if self.size else 1
        params = None
        if allowed is not None:
            allowed = np.ascontiguousarray(allowed, dtype=np.int64)
            sel = faiss.IDSelectorBatch(allowed)
            if self.ivf:  # probe 1/selectivity as many lists, so as many allowed vectors are scanned as unfiltered
                share = min(max(len(allowed), 1) / max(self.size, 1), 1.0)
                nprobe = min(self.index.nlist, int(np.ceil(self.index.nprobe / share)))
                params = faiss.SearchParametersIVF(sel=sel, nprobe=nprobe)
            else:
                params = faiss.SearchParameters(sel=sel)
        if self.ivf or params is not None or not gpu_available():
            return self.index.search(q, k, params=params)  # CPU searches may run concurrently
        with self._lock:  # a GPU index is not thread-safe
            if self._gpu is None:
                self._gpu = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, self.index)
            return self._gpu.search(q, k)

    def save(self, path: Path, meta: dict[str, object]) -> None:
        """Write the index and its sidecar (meta plus dim, count, kind, nprobe) atomically."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".faiss")
            os.close(fd)
            try:
                faiss.write_index(self.index, tmp)
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
            full = {**meta, "dim": self.dim, "count": self.size, "kind": self.kind, "nprobe": self.nprobe}
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w") as fh:
                json.dump(full, fh)
            os.replace(tmp, sidecar(path))

    @classmethod
    def load(cls, path: Path) -> tuple[AdapterIndex, dict]:
        """The index and its sidecar; ValueError when either is missing, unreadable or they disagree."""
        try:
            meta = json.loads(sidecar(path).read_text())
            index = faiss.read_index(str(path))
        except (OSError, RuntimeError, json.JSONDecodeError) as exc:
            raise ValueError(f"index file {path} is missing or unreadable ({type(exc).__name__})") from exc
        if int(index.ntotal) != meta.get("count") or int(index.d) != meta.get("dim"):
            raise ValueError(f"index file {path} disagrees with its sidecar")
        if isinstance(index, faiss.IndexIVF):
            index.nprobe = int(meta["nprobe"])
        return cls(index, int(meta["dim"])), meta


def sidecar(path: Path) -> Path:
    return Path(str(path) + ".json")


def brute_force(ids: np.ndarray, vectors: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The numpy reference: exact cosine top-k."""
    sims = normalize(queries) @ normalize(vectors).T
    order = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(sims, order, axis=1), np.asarray(ids, dtype=np.int64)[order]


def recall_at_k(approx_ids: np.ndarray, exact_ids: np.ndarray) -> float:
    hits = [len(set(a.tolist()) & set(e.tolist())) / max(1, len(e)) for a, e in zip(approx_ids, exact_ids, strict=True)]
    return float(np.mean(hits)) if hits else 1.0
