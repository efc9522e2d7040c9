"""FAISS index of one embedding space: ids are adapter ids, scores are cosine similarities.

Design around FAISS's limits:
- an exact index is `IndexIDMap2` over `IndexFlatIP`, which supports removal (flat storage
  compacts) and reconstruction; vectors are L2-normalized so inner product = cosine;
- above `APPROXIMATE_FROM` vectors an HNSW index is built instead; HNSW cannot remove ids, so
  removals rebuild it from the stored vectors (the database is the source of truth);
- GPU indexes take no custom ids and are not thread-safe: a GPU copy is used for searching
  only, refreshed after writes; CPU searches may run concurrently, writes take a lock;
- files are written atomically (temporary file + rename) with a sidecar holding the count and
  a checksum of (ids, vectors), so a mismatch with the database is detected and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path

import faiss
import numpy as np

APPROXIMATE_FROM = 50_000
HNSW_M = 32
HNSW_EF_SEARCH = 128


def normalize(vectors: np.ndarray) -> np.ndarray:
    v = np.ascontiguousarray(vectors, dtype=np.float32)
    if v.ndim == 1:
        v = v[None, :]
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    return v / np.maximum(norms, 1e-12)


def checksum(ids: np.ndarray, vectors: np.ndarray) -> str:
    """Order-independent digest of (id, vector) pairs as the database holds them."""
    ids = np.asarray(ids, dtype=np.int64)
    order = np.argsort(ids, kind="stable")
    h = hashlib.sha256(ids[order].tobytes())
    h.update(np.ascontiguousarray(np.asarray(vectors, dtype=np.float32)[order]).tobytes())
    return h.hexdigest()


def gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


class AdapterIndex:
    def __init__(self, dim: int, approximate: bool = False) -> None:
        self.dim = dim
        self.approximate = approximate
        self._lock = threading.Lock()
        self._gpu: faiss.Index | None = None
        if approximate:
            hnsw = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
            hnsw.hnsw.efSearch = HNSW_EF_SEARCH
            self.index: faiss.Index = faiss.IndexIDMap(hnsw)
        else:
            self.index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))

    @classmethod
    def build(cls, ids: np.ndarray, vectors: np.ndarray, approximate: bool | None = None) -> AdapterIndex:
        """A new index over (ids, vectors); approximate (HNSW) from APPROXIMATE_FROM vectors unless told."""
        if approximate is None:
            approximate = len(ids) >= APPROXIMATE_FROM
        index = cls(int(np.asarray(vectors).shape[1]), approximate)
        if len(ids):
            index.add(ids, vectors)
        return index

    @property
    def size(self) -> int:
        return int(self.index.ntotal)

    def ids(self) -> np.ndarray:
        return faiss.vector_to_array(self.index.id_map).astype(np.int64)

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        vectors = normalize(vectors)
        if vectors.shape != (len(ids), self.dim):
            raise ValueError(f"expected {len(ids)} vectors of dimension {self.dim}, got {vectors.shape}")
        with self._lock:
            present = np.intersect1d(ids, self.ids())
            if present.size:
                raise ValueError(f"ids already in the index: {present[:5].tolist()}")
            self.index.add_with_ids(vectors, ids)
            self._gpu = None

    def remove(self, ids: np.ndarray) -> int:
        """Remove ids (exact index only; an HNSW index must be rebuilt without them)."""
        if self.approximate:
            raise NotImplementedError("HNSW indexes cannot remove ids: rebuild the index from the database")
        with self._lock:
            removed = int(self.index.remove_ids(np.ascontiguousarray(ids, dtype=np.int64)))
            self._gpu = None
            return removed

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) of the k nearest by cosine, best first; id -1 pads when fewer exist."""
        q = normalize(queries)
        k = max(1, min(k, self.size)) if self.size else 1
        if self.approximate or not gpu_available():
            return self.index.search(q, k)  # CPU searches may run concurrently
        with self._lock:  # a GPU index is not thread-safe
            if self._gpu is None:
                self._gpu = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, self.index)
            return self._gpu.search(q, k)

    def save(self, path: Path, content_checksum: str) -> None:
        """Write the index and its sidecar atomically; content_checksum is that of the database rows."""
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
            meta = {"dim": self.dim, "count": self.size, "approximate": self.approximate, "checksum": content_checksum}
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w") as fh:
                json.dump(meta, fh)
            os.replace(tmp, sidecar(path))

    @classmethod
    def load(cls, path: Path) -> tuple[AdapterIndex, dict]:
        meta = json.loads(sidecar(path).read_text())
        obj = cls.__new__(cls)
        obj.dim = int(meta["dim"])
        obj.approximate = bool(meta["approximate"])
        obj._lock = threading.Lock()
        obj._gpu = None
        obj.index = faiss.read_index(str(path))
        if obj.approximate:
            faiss.downcast_index(obj.index.index).hnsw.efSearch = HNSW_EF_SEARCH
        return obj, meta


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
