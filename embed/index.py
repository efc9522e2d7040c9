"""The vectors of one embedder: stored by adapter id, searchable by cosine.

An `AdapterIndex` keeps every unit vector in a store of its own (a numpy array, row per adapter,
with a sorted id → row lookup), so re-ranking and filtered search read stored vectors by id and
never re-embed. How it searches depends on its size:
- below `IVF_FROM` vectors it is **flat**: exact cosine by brute force over the float32 store
  (`faiss.knn`, or `faiss.knn_gpu` when a GPU is present);
- from there on it is an **inverted file** (`IndexIVF`, ids = adapter ids) over compressed codes,
  with the store kept in float16 (half the memory; cosine error ~1e-3). The codes follow the
  dimension, as measured on the synthetic million-adapter space of `bench/serve.py`: at d ≥ 512
  (the module sketch: 24 modules × 64) product-quantizer fast-scan codes of 4 bits per 4
  dimensions scan 20–50× faster than float16 codes and hold 0.97 of the exact top 10 among 200
  candidates; at small d (the W2T embedding, 160) such codes never reach that recall, and
  float16 codes are cheap to scan anyway. Its `nprobe` is the smallest that puts `RECALL_GOAL` of
  the exact top 10 (brute force over the store) among its `CANDIDATES` nearest, measured on a
  sample of its own vectors when it is built; the engine re-ranks those candidates by the store.

Files: one safetensors file per index (ids, vectors, the serialized IVF and a metadata map),
written to a temporary file, fsynced, renamed over the old one and the directory fsynced, so a
reader sees the old file or the new one, whole. The metadata carries a SHA-256 of the ids and
the IVF bytes and the count; `load` refuses a file that disagrees with itself.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path

import faiss
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

IVF_FROM = 100_000
#: the first stage hands this many candidates to the exact re-ranking
CANDIDATES = 200
#: an IVF index's nprobe is the smallest that puts this share of the exact top 10 among its CANDIDATES
RECALL_GOAL = 0.97
NPROBES = (4, 8, 16, 32, 64, 128, 256)
#: a filtered IVF search scores the allowed vectors exactly while they hold at most this many numbers
#: (10,000 W2T vectors of 160, 1,300 module sketches of 1,536): cheaper than probing every list
EXACT_FILTER_BUDGET = 2_000_000
#: from this dimension on, IVF codes are product-quantizer fast-scan codes (4 bits per 4 dimensions)
PQ_FROM_DIM = 512


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


_GPU_LOCK = threading.Lock()


@functools.cache
def _gpu_resources():  # type: ignore[no-untyped-def]
    return faiss.StandardGpuResources()


class AdapterIndex:
    """One embedder's unit vectors by adapter id, searchable by cosine (flat or IVF, see the module doc)."""

    def __init__(self, dim: int, ivf: faiss.IndexIVF | None = None) -> None:
        self.dim = dim
        self._ivf = ivf
        self._dtype = np.float16 if ivf is not None else np.float32
        self._ids = np.zeros(0, np.int64)
        self._store = np.zeros((0, dim), self._dtype)
        self._size = 0
        self._sorted_ids = np.zeros(0, np.int64)
        self._sorted_rows = np.zeros(0, np.int64)
        self._lock = threading.Lock()

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def exact(cls, dim: int) -> AdapterIndex:
        return cls(dim)

    @classmethod
    def build(cls, ids: np.ndarray, vectors: np.ndarray, ivf: bool | None = None) -> AdapterIndex:
        """An index over (ids, vectors): flat below IVF_FROM vectors, IVF from there (unless told)."""
        vectors = normalize(vectors) if len(ids) else np.zeros((0, np.asarray(vectors).shape[-1]), np.float32)
        dim = int(vectors.shape[1])
        if ivf is None:
            ivf = len(ids) >= IVF_FROM
        if not ivf:
            index = cls.exact(dim)
            index.add(ids, vectors)
            return index
        rng = np.random.default_rng(0)
        sample = vectors[rng.choice(len(vectors), size=min(len(vectors), 64 * ivf_lists(len(ids))), replace=False)]
        obj = cls.trained_ivf(sample, len(ids))
        obj.add(ids, vectors)
        obj.tune_nprobe(vectors[rng.choice(len(vectors), size=min(len(vectors), 200), replace=False)])
        return obj

    @classmethod
    def trained_ivf(cls, sample: np.ndarray, expected: int) -> AdapterIndex:
        """An empty IVF index for about `expected` vectors, its coarse quantizer and codes trained on
        `sample` (add the vectors, then `tune_nprobe`)."""
        sample = normalize(sample)
        dim = int(sample.shape[1])
        quantizer = faiss.IndexFlatIP(dim)
        lists = ivf_lists(expected)
        if dim >= PQ_FROM_DIM and dim % 4 == 0:
            index = faiss.IndexIVFPQFastScan(quantizer, dim, lists, dim // 4, 4, faiss.METRIC_INNER_PRODUCT)
        else:
            index = faiss.IndexIVFScalarQuantizer(quantizer, dim, lists, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
        index.train(sample)
        index.nprobe = min(NPROBES[0], lists)
        return cls(dim, index)

    # -- what it holds -------------------------------------------------------------------------

    @property
    def kind(self) -> str:
        return "ivf" if self.ivf else "flat"

    @property
    def ivf(self) -> bool:
        return self._ivf is not None

    @property
    def codes(self) -> str | None:
        """The IVF's codes: 'pq4 fast-scan' or 'fp16'; None when flat."""
        if self._ivf is None:
            return None
        return "pq4 fast-scan" if isinstance(self._ivf, faiss.IndexIVFPQFastScan) else "fp16"

    @property
    def nprobe(self) -> int | None:
        return int(self._ivf.nprobe) if self._ivf is not None else None

    @property
    def size(self) -> int:
        return self._size

    @property
    def ids(self) -> np.ndarray:
        return self._ids[: self._size]

    def _rows(self, ids: np.ndarray) -> np.ndarray:
        """Store rows of these ids; -1 where an id is absent."""
        pos = np.searchsorted(self._sorted_ids, ids)
        pos = np.minimum(pos, max(len(self._sorted_ids) - 1, 0))
        found = (self._sorted_ids[pos] == ids) if len(self._sorted_ids) else np.zeros(len(ids), bool)
        return np.where(found, self._sorted_rows[pos] if len(self._sorted_rows) else -1, -1)

    def contains(self, adapter_id: int) -> bool:
        return bool(self._rows(np.array([adapter_id], np.int64))[0] >= 0)

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        """(len(ids), dim) float32 stored unit vectors of these adapter ids (KeyError for one not in the index)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        rows = self._rows(ids)
        if (rows < 0).any():
            raise KeyError(f"adapters not in the index: {ids[rows < 0][:5].tolist()}")
        return self._store[rows].astype(np.float32, copy=False)

    # -- writes --------------------------------------------------------------------------------

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Add new ids (ValueError for one already present)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if not len(ids):
            return
        vectors = normalize(vectors)
        if vectors.shape != (len(ids), self.dim):
            raise ValueError(f"expected {len(ids)} vectors of dimension {self.dim}, got {vectors.shape}")
        with self._lock:
            present = self._rows(ids) >= 0
            if present.any() or len(np.unique(ids)) != len(ids):
                raise ValueError(f"ids already in the index: {ids[present][:5].tolist() or 'repeated in the batch'}")
            self._append(ids, vectors)
            if self._ivf is not None:
                self._ivf.add_with_ids(vectors, ids)

    def _append(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        need = self._size + len(ids)
        if self._size == 0 and vectors.dtype == self._dtype:  # a fresh index takes the arrays as they are
            self._ids, self._store = np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(vectors)
        elif need > len(self._ids):  # grow by half again: amortized O(1) per vector
            capacity = max(need, int(len(self._ids) * 1.5), 1024)
            grown_ids = np.zeros(capacity, np.int64)
            grown_ids[: self._size] = self._ids[: self._size]
            grown = np.zeros((capacity, self.dim), self._dtype)
            grown[: self._size] = self._store[: self._size]
            self._ids, self._store = grown_ids, grown
        if self._ids is not ids:
            self._ids[self._size : need] = ids
            self._store[self._size : need] = vectors
        self._size = need
        self._sorted_rows = np.argsort(self._ids[: self._size], kind="stable")
        self._sorted_ids = self._ids[: self._size][self._sorted_rows]

    def upsert(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Add vectors, replacing those of ids already present (a re-embedded adapter)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if not len(ids):
            return
        vectors = normalize(vectors)
        rows = self._rows(ids)
        old = rows >= 0
        if old.any():
            with self._lock:
                self._store[rows[old]] = vectors[old]
                if self._ivf is not None:
                    self._ivf.remove_ids(ids[old])
                    self._ivf.add_with_ids(vectors[old], ids[old])
        self.add(ids[~old], vectors[~old])

    # -- search --------------------------------------------------------------------------------

    def search(self, queries: np.ndarray, k: int, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) of the k nearest by the stored vectors' cosine, best first; id -1 pads when fewer
        exist. Flat: exact. IVF: its max(k, CANDIDATES) nearest by the codes, re-ranked by the store.
        `allowed`: only these adapter ids (flat, or few enough for EXACT_FILTER_BUDGET: exact over their
        rows; else a FAISS id selector probing nprobe / share of the lists, all of them for a small share)."""
        q = normalize(queries)
        k = max(1, k)
        if self._ivf is None:
            rows = np.arange(self._size) if allowed is None else np.sort(self._rows(np.asarray(allowed, np.int64)))
            rows = rows[rows >= 0]
            return self._exact(q, rows, k)
        params = None
        if allowed is not None:
            allowed = np.ascontiguousarray(allowed, dtype=np.int64)
            if len(allowed) * self.dim <= EXACT_FILTER_BUDGET:  # few enough to score them all from the store
                rows = np.sort(self._rows(allowed))
                return self._exact(q, rows[rows >= 0], k)
            share = min(max(len(allowed), 1) / max(self._size, 1), 1.0)
            nprobe = min(self._ivf.nlist, int(np.ceil(self._ivf.nprobe / share)))
            params = faiss.SearchParametersIVF(sel=faiss.IDSelectorBatch(allowed), nprobe=nprobe)
        _, candidates = self._ivf.search(q, min(max(k, CANDIDATES), max(self._size, 1)), params=params)
        scores = np.full((len(q), k), -np.inf, np.float32)
        ids = np.full((len(q), k), -1, np.int64)
        for i, found in enumerate(candidates):  # re-ranked by the stored vectors
            found = found[found >= 0]
            s = self.vectors(found) @ q[i]
            top = np.argsort(-s, kind="stable")[:k]
            scores[i, : len(top)], ids[i, : len(top)] = s[top], found[top]
        return scores, ids

    def _exact(self, q: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        scores = np.full((len(q), k), -np.inf, np.float32)
        ids = np.full((len(q), k), -1, np.int64)
        if not len(rows):
            return scores, ids
        base = self._store[: self._size] if len(rows) == self._size else self._store[rows]
        kk = min(k, len(rows))
        if gpu_available():
            with _GPU_LOCK:  # one StandardGpuResources is not thread-safe
                s, r = faiss.knn_gpu(_gpu_resources(), q, np.ascontiguousarray(base, np.float32), kk, metric=faiss.METRIC_INNER_PRODUCT)
        else:
            s, r = faiss.knn(q, np.ascontiguousarray(base, np.float32), kk, metric=faiss.METRIC_INNER_PRODUCT)
        scores[:, :kk] = s
        ids[:, :kk] = np.where(r >= 0, self._ids[rows[np.maximum(r, 0)]], -1)
        return scores, ids

    def exact_top(self, queries: np.ndarray, k: int, chunk: int = 50_000) -> np.ndarray:
        """(len(queries), k) ids of the exact top k over the whole store, by brute force in chunks."""
        q = normalize(queries)
        best_s = np.full((len(q), 0), -np.inf, np.float32)
        best_i = np.zeros((len(q), 0), np.int64)
        for start in range(0, self._size, chunk):
            stop = min(self._size, start + chunk)
            s = q @ self._store[start:stop].astype(np.float32).T
            all_s = np.concatenate([best_s, s], axis=1)
            all_i = np.concatenate([best_i, np.broadcast_to(self._ids[start:stop], s.shape)], axis=1)
            top = np.argsort(-all_s, axis=1, kind="stable")[:, :k]
            best_s, best_i = np.take_along_axis(all_s, top, 1), np.take_along_axis(all_i, top, 1)
        return best_i

    def tune_nprobe(self, queries: np.ndarray, k: int = 10, candidates: int = CANDIDATES) -> float:
        """Set nprobe to the smallest in NPROBES whose `candidates` nearest hold RECALL_GOAL of the exact
        top k (brute force over the store: what re-ranking the candidates then serves); returns that recall."""
        if self._ivf is None:
            return 1.0
        exact = self.exact_top(queries, k)
        recall = 1.0
        for nprobe in [p for p in NPROBES if p < self._ivf.nlist] + [self._ivf.nlist]:
            self._ivf.nprobe = nprobe
            found = self._ivf.search(normalize(queries), candidates)[1]
            recall = recall_at_k(found, exact)
            if recall >= RECALL_GOAL:
                break
        return recall

    # -- files -----------------------------------------------------------------------------------

    def save(self, path: Path, meta: dict[str, object]) -> None:
        """Write the index with `meta` (plus dim, count, kind, nprobe, checksum) atomically and durably."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            ids = np.ascontiguousarray(self.ids)
            tensors = {"ids": ids, "vectors": np.ascontiguousarray(self._store[: self._size])}
            if self._ivf is not None:
                tensors["ivf"] = faiss.serialize_index(self._ivf)
            full = {**meta, "dim": self.dim, "count": self._size, "kind": self.kind, "nprobe": self.nprobe}
            full["checksum"] = _checksum(ids, tensors.get("ivf"))
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".index")
            os.close(fd)
            try:
                save_file(tensors, tmp, metadata={"zoo": json.dumps(full)})
                with open(tmp, "rb+") as fh:
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    @classmethod
    def load(cls, path: Path) -> tuple[AdapterIndex, dict]:
        """The index and its metadata; ValueError when the file is missing, unreadable or disagrees with itself."""
        try:
            with safe_open(str(path), "np") as fh:
                meta = json.loads((fh.metadata() or {})["zoo"])
                tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 - safe_open has no __iter__
            dim, count = int(meta["dim"]), int(meta["count"])
            ids, vectors = tensors["ids"], tensors["vectors"]
        except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
            raise ValueError(f"index file {path} is missing or unreadable ({type(exc).__name__})") from None
        ivf_bytes = tensors.get("ivf")
        if len(ids) != count or vectors.shape != (count, dim) or meta.get("checksum") != _checksum(ids, ivf_bytes):
            raise ValueError(f"index file {path} disagrees with itself (count, shape or checksum)")
        ivf = faiss.deserialize_index(ivf_bytes) if ivf_bytes is not None else None
        if ivf is not None:
            if int(ivf.ntotal) != count:
                raise ValueError(f"index file {path} disagrees with itself (the IVF holds {ivf.ntotal} of {count})")
            ivf.nprobe = int(meta["nprobe"])
        index = cls(dim, ivf)
        index._append(ids, vectors.astype(index._dtype, copy=False))
        return index, meta


def _checksum(ids: np.ndarray, ivf_bytes: np.ndarray | None) -> str:
    h = hashlib.sha256(np.ascontiguousarray(ids, np.int64).tobytes())
    if ivf_bytes is not None:
        h.update(np.ascontiguousarray(ivf_bytes).tobytes())
    return h.hexdigest()


def brute_force(ids: np.ndarray, vectors: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The numpy reference: exact cosine top-k."""
    sims = normalize(queries) @ normalize(vectors).T
    order = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(sims, order, axis=1), np.asarray(ids, dtype=np.int64)[order]


def recall_at_k(approx_ids: np.ndarray, exact_ids: np.ndarray) -> float:
    hits = [len(set(a.tolist()) & set(e.tolist())) / max(1, len(e)) for a, e in zip(approx_ids, exact_ids, strict=True)]
    return float(np.mean(hits)) if hits else 1.0
