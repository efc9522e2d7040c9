"""The vectors of one embedder: stored by adapter id, searchable by cosine.

An `AdapterIndex` keeps every unit vector in a store of its own (a numpy array, row per adapter,
with a sorted id → row lookup), so re-ranking and filtered search read stored vectors by id and
never re-embed. How it searches depends on its size:
- below `IVF_FROM` vectors it is **flat**: exact cosine by brute force over the float32 store
  (`faiss.knn`, or `faiss.knn_gpu` when a GPU is present);
- from there on it is an **inverted file** (`IndexIVF`, ids = adapter ids) over compressed codes,
  with the store compressed too: by default at d ≥ 512 one byte a dimension (a quarter of float32; one
  range for every dimension, symmetric about 0, trained on the sample; a cosine with a unit query is off by
  (range / 255) / √12 in standard deviation, 3.9e-4 on Llama-3-8B's 2,016-dimensional module sketches), below that
  float16 (a cosine off by ~1e-5; the W2T embedding's neighbours can be that close). 8 bits reorder neighbours
  closer than their error, so a search whose scores are an 8-bit store's cosines orders the candidates near its
  k-th by the database's float32 vectors (embed/serving/exact_rows.py). The codes follow the
  dimension, as measured on the synthetic spaces of `bench/serve.py`: at d ≥ 512 (the module
  sketch: 24 modules × 64) product-quantizer fast-scan codes of 4 bits per 4 dimensions scan
  20–50× faster than float16 codes; at small d (the W2T embedding, 160) such codes never put 0.97
  of the exact top 10 among even 200 candidates, and float16 codes are cheap to scan anyway. The
  IVF's nearest by the codes are re-ranked by the store; how many (`rerank`) and how many lists it
  probes (`nprobe`) are tuned together when it is built (`tune_nprobe`), on a sample of its own
  vectors, to put `RECALL_GOAL` of the exact top 10 among them at the least measured time.

Filtered search (`allowed` ids) takes the cheapest of three ways:
- **exact** over the allowed rows of the store while they are no more than the subset way would
  re-rank anyway (`filter_rerank`);
- **subset**: an IVF index also keeps every row as an 8-bit product-quantizer code of 8 dimensions
  a byte (zero-padded to a multiple of 8; 192 bytes for a module sketch), in row order, so the allowed rows' codes are gathered and
  scored by FAISS's asymmetric distance (cost ∝ allowed rows), and their `filter_rerank` nearest
  re-ranked by the store;
- **probe**: the IVF with an id selector over `filtered_nprobe(share)` lists (cost ∝ lists probed).
The subset's re-rank depth and the probe's lists are measured when the index is built, under a
random filter keeping `FILTER_SHARE` of the rows, and so is each way's time; a query takes the way
whose measured cost, scaled to its own filter, is lower.

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
import threading
import time
from pathlib import Path
from typing import cast

# FAISS's OpenMP threads sleep when idle instead of spinning (unless the user chose): with other work on the cores,
# spinning threads wait on each other. On a busy 2-core machine, training one index's fast-scan codes (6,000 × 525)
# took 136 s on 2 spinning threads, 2.6 s on 2 passive ones, 3.5 s on one. Read when OpenMP starts: before the import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import faiss  # noqa: E402
import numpy as np

from embed.serving.exact_search import TIE, TiedTop, normalize
from embed.serving.index_rows import IndexRows, store_step, trained_store
from zoo.files import read_derived, read_derived_mapped, write_derived

IVF_FROM = 100_000
#: the first stage hands this many candidates to the exact re-ranking
CANDIDATES = 200
#: an IVF index's nprobe is the smallest that puts this share of the exact top 10 among its CANDIDATES
RECALL_GOAL = 0.98
#: where no setting reaches RECALL_GOAL, the tuner's goal is the most any holds less this (`tune_nprobe`)
TUNE_SLACK = 0.01
NPROBES = (4, 8, 16, 32, 64, 128, 256)
#: how deep the exact ranking is read to find the ties of the k-th
TIE_DEPTH = CANDIDATES
#: how many of an IVF's nearest by the codes are re-ranked by the store (tuned with nprobe)
RERANKS = (CANDIDATES, 500, 1000, 2000)
#: the filter share at which an IVF's filtered nprobe is measured when it is built
FILTER_SHARE = 0.01
#: from this dimension on, IVF codes are product-quantizer fast-scan codes (4 bits per 4 dimensions: pq_subquantizers)
PQ_FROM_DIM = 512
#: the subset codes: one byte per this many dimensions, the vectors padded with zeros to a multiple of it (FAISS encodes
#: parts of 8 dimensions with a kernel of their own: SDXL's 1,035-dimensional sketches in parts of 5, the largest divisor,
#: took 12x as long, 11.5 s per 20,000 vectors, more than the rest of adding them together)
SUBSET_DIMS_PER_BYTE = 8
#: vectors the subset codes are trained on
SUBSET_TRAIN = 20_000
#: k-means iterations of each part of the subset codes (FAISS's default 25), trained on one thread: 207 k-means of
#: 256 centroids in 5 dimensions took 361 s on two threads of a busy machine, 148 s with 10 iterations, and one thread
#: halves that again (OpenMP's overhead on so small a problem), while the codes' error barely moves (0.0511 → 0.0522)
SUBSET_ITERATIONS = 10
#: an IVF index file's parts that `AdapterIndex.load` maps rather than reads (the serialized IVF with its store, and the
#: subset codes): FAISS reads them in place (IO_FLAG_MMAP_IFC), so the codes stay in the page cache
MAPPED_PARTS = ("ivf", "subset")


def pq_subquantizers(dim: int) -> int:
    """Sub-quantizers of the fast-scan codes: dim / 4 (4 bits per 4 dimensions) where 4 divides dim, else the fewest
    that divide it into parts of at most 4 dimensions (SDXL's 1,035 sketch dimensions: 345 parts of 3)."""
    return next(m for m in range(-(-dim // 4), dim + 1) if dim % m == 0)


def ivf_lists(n: int) -> int:
    """Inverted lists for n vectors: 2·√n (2,000 at a million: 500 vectors a list), at most n / 39 so
    that k-means has 39 points a list."""
    return int(min(max(16, 2 * np.sqrt(n)), max(1, n // 39)))


def gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


_GPU_LOCK = threading.Lock()


@functools.cache
def _gpu_resources() -> faiss.StandardGpuResources:
    return faiss.StandardGpuResources()


class AdapterIndex(IndexRows):
    """One embedder's unit vectors by adapter id (its rows and their store: `IndexRows`), searchable by cosine (flat or
    IVF, see the module doc)."""

    def __init__(self, dim: int, ivf: faiss.IndexRefine | None = None) -> None:
        super().__init__(dim, ivf)
        self.rerank = CANDIDATES
        self.filter_nprobe = faiss.extract_index_ivf(ivf.base_index).nlist if ivf is not None else 0
        self.filter_rerank = RERANKS[-1]
        self.subset_row_s = np.inf  # measured cost of the subset way per allowed row, and of the probe way per list
        self.probe_list_s = 0.0

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def exact(cls, dim: int) -> AdapterIndex:
        return cls(dim)

    @classmethod
    def build(cls, ids: np.ndarray, vectors: np.ndarray, ivf: bool | None = None, store: str | None = None) -> AdapterIndex:
        """An index over (ids, vectors): flat below IVF_FROM vectors, IVF from there (unless told), its store as
        `trained_ivf`'s."""
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
        obj = cls.trained_ivf(sample, len(ids), store)
        obj.add(ids, vectors)
        tune = rng.choice(len(vectors), size=min(len(vectors), 200), replace=False)
        obj.tune_nprobe(vectors[tune], ids[tune])
        return obj

    @classmethod
    def trained_ivf(cls, sample: np.ndarray, expected: int, store: str | None = None) -> AdapterIndex:
        """An empty IVF index for about `expected` vectors, its coarse quantizer, codes and store trained on
        `sample` (add the vectors, then `tune_nprobe`). `store`: '8-bit' or 'fp16' (default: by the dimension,
        STORE_8BIT_FROM_DIM)."""
        sample = normalize(sample)
        dim = int(sample.shape[1])
        quantizer = faiss.IndexFlatIP(dim)
        lists = ivf_lists(expected)
        base: faiss.IndexIVF
        if dim >= PQ_FROM_DIM:
            base = faiss.IndexIVFPQFastScan(quantizer, dim, lists, pq_subquantizers(dim), 4, faiss.METRIC_INNER_PRODUCT)
        else:
            base = faiss.IndexIVFScalarQuantizer(quantizer, dim, lists, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
        t0 = time.perf_counter()
        base.train(sample)
        base.nprobe = min(NPROBES[0], lists)
        t1 = time.perf_counter()
        store_index = trained_store(sample, store)
        t2 = time.perf_counter()
        refine = faiss.IndexRefine(base, store_index)
        # the C++ objects own their parts (as a deserialized index does), not these Python wrappers
        base.own_fields, refine.own_fields = True, True
        for part in (quantizer, base, store_index):
            part.this.disown()  # type: ignore[union-attr]  # SWIG's handle on the C++ object: not in faiss's stubs
        index = cls(dim, refine)
        padded = dim + -dim % SUBSET_DIMS_PER_BYTE
        index._subset = faiss.IndexPQ(padded, padded // SUBSET_DIMS_PER_BYTE, 8, faiss.METRIC_INNER_PRODUCT)
        index._subset.pq.cp.niter = SUBSET_ITERATIONS
        threads = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(1)
        try:
            index._subset.train(index._subset_input(sample[np.random.default_rng(1).permutation(len(sample))[:SUBSET_TRAIN]]))
        finally:
            faiss.omp_set_num_threads(threads)
        index.timings = {"train_ivf_s": t1 - t0, "train_store_s": t2 - t1, "train_subset_s": time.perf_counter() - t2}
        return index

    @property
    def tie(self) -> float:
        """Exact scores this close to the k-th are ties when nprobe is tuned: TIE, or for an 8-bit store two standard
        deviations of its error in a cosine with a unit query, 2 · step / √12 (a coordinate rounded to a step of the
        range / 255 is off by a uniform error of ± step / 2)."""
        if self.store != "8-bit":
            return TIE
        return max(TIE, 2 * store_step(self.store_quantizer) / np.sqrt(12))

    # -- search --------------------------------------------------------------------------------

    def search(self, queries: np.ndarray, k: int, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids) of the k nearest by the stored vectors' cosine, best first; id -1 pads when fewer
        exist. Flat: exact. IVF: its max(k, rerank) nearest by the codes, re-ranked by the store in FAISS.
        `allowed`: only these adapter ids, by the cheapest way (module doc: exact, subset or probe)."""
        q = normalize(queries)
        k = max(1, k)
        rows = None
        if allowed is not None:
            rows = np.sort(self.rows_of(np.ascontiguousarray(allowed, dtype=np.int64)))
            rows = rows[rows >= 0]
        if self._ivf is None or (rows is not None and len(rows) <= max(k, self.filter_rerank)):
            return self._exact(q, np.arange(self._size) if rows is None else rows, k)
        if rows is not None and self.subset_cheaper(len(rows)):
            return self.search_subset(q, rows, k)
        return self._probe(q, k, rows)

    def subset_cheaper(self, allowed: int) -> bool:
        """Whether a filter keeping `allowed` rows costs less by the subset codes than by probing lists."""
        return allowed * self.subset_row_s <= self.filtered_nprobe(allowed / max(self._size, 1)) * self.probe_list_s

    def _probe(self, q: np.ndarray, k: int, rows: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The IVF's nearest (among `rows` by an id selector), re-ranked by the store in FAISS."""
        nprobe = self.ivf_base.nprobe if rows is None else self.filtered_nprobe(len(rows) / max(self._size, 1))
        # faiss's wrapper sets search parameters from keywords (and keeps their objects alive); its stubs know no keywords
        sel = faiss.IDSelectorBatch(rows) if rows is not None else None
        base_params = faiss.SearchParametersIVF(nprobe=nprobe, sel=sel)  # type: ignore[call-arg]
        kk = min(k, self._size)
        params = faiss.IndexRefineSearchParameters(k_factor=max(kk, self.rerank) / kk, base_index_params=base_params)  # type: ignore[call-arg]
        scores = np.full((len(q), k), -np.inf, np.float32)
        ids = np.full((len(q), k), -1, np.int64)
        s, r = self._refine.search(q, kk, params=params)
        scores[:, :kk] = s
        ids[:, :kk] = self._ids_of(r)
        return scores, ids

    def _subset_nearest(self, q: np.ndarray, rows: np.ndarray, depth: int) -> np.ndarray:
        """(len(q), depth) rows of `rows` nearest by the subset codes (-1 pads)."""
        codes = np.ascontiguousarray(self.subset_codes()[rows])
        depth = min(depth, len(rows))
        values = np.empty((len(q), depth), np.float32)
        found = np.empty((len(q), depth), np.int64)
        heap = faiss.float_minheap_array_t()
        heap.nh, heap.k, heap.val, heap.ids = len(q), depth, faiss.swig_ptr(values), faiss.swig_ptr(found)
        q = self._subset_input(q)
        self.subset_index.pq.search_ip(faiss.swig_ptr(q), len(q), faiss.swig_ptr(codes), len(codes), heap, True)
        return np.where(found >= 0, rows[np.maximum(found, 0)], -1)

    def search_subset(self, q: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The `filter_rerank` nearest among `rows` by the subset codes, re-ranked by the store."""
        scores = np.full((len(q), k), -np.inf, np.float32)
        ids = np.full((len(q), k), -1, np.int64)
        for i, (row, found) in enumerate(zip(q, self._subset_nearest(q, rows, max(k, self.filter_rerank)), strict=True)):
            found = found[found >= 0]
            exact = self._at(found) @ row
            top = np.argsort(-exact, kind="stable")[:k]
            scores[i, : len(top)] = exact[top]
            ids[i, : len(top)] = self._ids[found[top]]
        return scores, ids

    def _exact(self, q: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        scores = np.full((len(q), k), -np.inf, np.float32)
        ids = np.full((len(q), k), -1, np.int64)
        if not len(rows):
            return scores, ids
        base = self._flat[: self._size] if self._ivf is None and len(rows) == self._size else self._at(rows)
        kk = min(k, len(rows))
        if gpu_available():
            with _GPU_LOCK:  # one StandardGpuResources is not thread-safe
                s, r = faiss.knn_gpu(_gpu_resources(), q, np.ascontiguousarray(base), kk, metric=faiss.METRIC_INNER_PRODUCT)
        else:
            s, r = faiss.knn(q, np.ascontiguousarray(base), kk, metric=faiss.METRIC_INNER_PRODUCT)
        scores[:, :kk] = s
        ids[:, :kk] = self._ids_of(np.where(r >= 0, rows[np.maximum(r, 0)], -1))
        return scores, ids

    def exact_top(self, queries: np.ndarray, k: int, chunk: int = 50_000) -> tuple[np.ndarray, np.ndarray]:
        """(scores, ids), each (len(queries), k), of the exact top k over the whole store, by brute force in chunks."""
        q = normalize(queries)
        best_s = np.full((len(q), 0), -np.inf, np.float32)
        best_i = np.zeros((len(q), 0), np.int64)
        for start in range(0, self._size, chunk):
            stop = min(self._size, start + chunk)
            s = q @ self._at(np.arange(start, stop)).T
            all_s = np.concatenate([best_s, s], axis=1)
            all_i = np.concatenate([best_i, np.broadcast_to(self._ids[start:stop], s.shape)], axis=1)
            top = np.argsort(-all_s, axis=1, kind="stable")[:, :k]
            best_s, best_i = np.take_along_axis(all_s, top, 1), np.take_along_axis(all_i, top, 1)
        return best_s, best_i

    def tune_nprobe(self, queries: np.ndarray, query_ids: np.ndarray | None = None, k: int = 10, max_nprobe: int | None = None) -> float:
        """Set (nprobe, rerank): for each re-rank depth in RERANKS the smallest nprobe in NPROBES whose
        `rerank` nearest by the codes hold RECALL_GOAL of the exact top k (brute force over the store),
        then of those the pair whose whole search (codes and re-ranking) is fastest on these queries. Where every list
        (at most `max_nprobe`) and the deepest re-rank hold less than the goal, so does every pair: the goal is then
        what they hold less TUNE_SLACK (in a space of near-ties the store's rounding decides the top 10: a million
        SDXL adapters mixed from 40 real ones probed all 2,000 lists, p99 26 ms for recall@10 0.716). Returns the
        recall of the pair. Queries that are stored vectors (`query_ids`) have their own row left out of their exact top k (a
        search leaves the query out), and ties are TIE apart whatever the store, as a search whose scores come from
        an 8-bit store orders its top k by the float32 vectors (embed/serving/exact_rows.py)."""
        if self._ivf is None:
            return 1.0
        t0 = time.perf_counter()
        q = normalize(queries)
        scores, ids = self.exact_top(q, TIE_DEPTH + 1)
        others = ids != (np.full(len(q), -1) if query_ids is None else np.asarray(query_ids, np.int64))[:, None]
        others[others.all(axis=1), -1] = False  # a query not found among its own nearest: its last one goes instead
        exact = TiedTop(scores[others].reshape(len(q), -1), ids[others].reshape(len(q), -1), k)
        base = self.ivf_base
        most = min(base.nlist, max_nprobe or base.nlist)
        ladder = [p for p in NPROBES if p < most] + [most]
        viable: list[tuple[float, int, int, float]] = []

        def recall_of(nprobe: int, rerank: int) -> float:
            base.nprobe = nprobe
            found = base.search(q, min(rerank, self._size))[1]
            return exact.recall(self._ids_of(found))

        goal = min(RECALL_GOAL, recall_of(most, RERANKS[-1]) - TUNE_SLACK)
        for rerank in RERANKS:
            for nprobe in ladder:
                recall = recall_of(nprobe, rerank)
                if recall >= goal:
                    self.rerank = rerank
                    started = time.perf_counter()
                    for row in q:
                        self.search(row[None, :], CANDIDATES)
                    viable.append((time.perf_counter() - started, nprobe, rerank, recall))
                    break
        if viable:
            _, nprobe, rerank, recall = min(viable)
        else:
            nprobe, rerank = most, RERANKS[-1]
            recall = recall_of(nprobe, rerank)
        base.nprobe, self.rerank = nprobe, rerank
        self._tune_filtered(q, k)
        self.timings["tune_s"] = time.perf_counter() - t0
        return recall

    def _tune_filtered(self, q: np.ndarray, k: int) -> None:
        """Under a random filter keeping FILTER_SHARE of the rows, set `filter_nprobe` (the fewest lists, a
        power of two times nprobe, whose candidates hold RECALL_GOAL of the exact top k among the allowed)
        and `filter_rerank` (the fewest subset-code nearest that do), and time both ways per query.
        Below CANDIDATES allowed rows at that share nothing is measured: probing takes every list, and the
        subset way, bounded by so few rows, is always taken."""
        base = self.ivf_base
        self.filter_nprobe, self.filter_rerank = base.nlist, RERANKS[-1]
        self.subset_row_s, self.probe_list_s = 0.0, np.inf
        if self._size * FILTER_SHARE < CANDIDATES:
            return
        rng = np.random.default_rng(0)
        rows = np.sort(rng.choice(self._size, int(self._size * FILTER_SHARE), replace=False))
        scores = q @ self._at(rows).T
        order = np.argsort(-scores, axis=1, kind="stable")[:, :TIE_DEPTH]
        exact = TiedTop(np.take_along_axis(scores, order, 1), self._ids[rows[order]], k, self.tie)
        nprobe = base.nprobe
        while nprobe < base.nlist:
            params = faiss.SearchParametersIVF(nprobe=nprobe, sel=faiss.IDSelectorBatch(rows))  # type: ignore[call-arg]  # see _probe
            found = base.search(q, min(self.rerank, len(rows)), params=params)[1]
            if exact.recall(self._ids_of(found)) >= RECALL_GOAL:
                break
            nprobe *= 2
        self.filter_nprobe = min(nprobe, base.nlist)
        self.filter_rerank = next(
            (r for r in RERANKS if exact.recall(self._ids_of(self._subset_nearest(q, rows, r))) >= RECALL_GOAL), RERANKS[-1]
        )
        t0 = time.perf_counter()
        for row in q:
            self.search_subset(row[None, :], rows, CANDIDATES)
        t1 = time.perf_counter()
        for row in q:
            self._probe(row[None, :], CANDIDATES, rows)
        t2 = time.perf_counter()
        self.subset_row_s = (t1 - t0) / len(q) / len(rows)
        self.probe_list_s = (t2 - t1) / len(q) / self.filter_nprobe

    def filtered_nprobe(self, share: float) -> int:
        """Lists to probe under a filter keeping `share` of the rows: nprobe at share 1, `filter_nprobe`
        at FILTER_SHARE, geometric in between and beyond (at most every list)."""
        base = self.ivf_base
        if share >= 1:
            return int(base.nprobe)
        exponent = np.log(1 / share) / np.log(1 / FILTER_SHARE)
        return int(min(base.nlist, np.ceil(base.nprobe * (self.filter_nprobe / base.nprobe) ** exponent)))

    # -- files -----------------------------------------------------------------------------------

    def save(self, path: Path, meta: dict[str, object]) -> None:
        """Write the index with `meta` (plus dim, count, kind, nprobe, rerank, checksum) atomically and durably."""
        with self._lock:
            ids = np.ascontiguousarray(self._ids[: self._size])  # dead rows (-1) included: they are rows of the store
            tensors: dict[str, np.ndarray] = {"ids": ids}
            if self._ivf is None:
                tensors["vectors"] = np.ascontiguousarray(self._flat[: self._size])
            else:
                tensors["ivf"] = faiss.serialize_index(self._ivf)
                tensors["subset"] = faiss.serialize_index(self.subset_index)
            full = {
                **meta,
                "dim": self.dim,
                "count": self._size,
                "kind": self.kind,
                "nprobe": self.nprobe,
                "rerank": self.rerank,
                "filter_nprobe": self.filter_nprobe,
                "filter_rerank": self.filter_rerank,
                "subset_row_s": self.subset_row_s,
                "probe_list_s": self.probe_list_s,
            }
            write_derived(path, tensors, full)

    @classmethod
    def load(cls, path: Path, mapped: bool = True) -> tuple[AdapterIndex, dict]:
        """The index and its metadata; ValueError when the file is missing, unreadable or disagrees with itself.
        `mapped`: an IVF index's codes, store and subset codes are read in place from the file (MAPPED_PARTS), not
        copied into the process's memory, until it is first written to (`_own`)."""
        if mapped:
            try:
                tensors, meta = read_derived_mapped(path, "index", MAPPED_PARTS)
            except ValueError:  # a file in an older layout (or damaged: read_derived says how)
                mapped = False
        if not mapped:
            tensors, meta = read_derived(path, "index", legacy=_legacy_index_meta)
        try:
            dim, count = int(meta["dim"]), int(meta["count"])
            ids = tensors["ids"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"index file {path} disagrees with itself (its metadata)") from None
        ivf_bytes, subset_bytes = tensors.pop("ivf", None), tensors.pop("subset", None)
        flat = tensors.get("vectors")
        consistent = len(ids) == count and (
            (ivf_bytes is not None and subset_bytes is not None) or (flat is not None and flat.shape == (count, dim))
        )
        if not consistent:
            raise ValueError(f"index file {path} disagrees with itself (count or shape)")
        mapped = mapped and ivf_bytes is not None
        read = _read_in_place if mapped else faiss.deserialize_index
        # deserialize_index returns the index as its own class, typed in faiss's stubs as any Index
        ivf = cast(faiss.IndexRefine, read(ivf_bytes)) if ivf_bytes is not None else None
        index = cls(dim, ivf)
        if ivf is not None:
            assert subset_bytes is not None and ivf_bytes is not None  # consistent
            index._subset = cast(faiss.IndexPQ, read(subset_bytes))
            if mapped:
                index.mapped_parts = {"ivf": ivf_bytes, "subset": subset_bytes}
            if int(ivf.ntotal) != count or int(ivf.d) != dim or int(index._subset.ntotal) != count:
                raise ValueError(f"index file {path} disagrees with itself (the IVF holds {ivf.ntotal} of {count})")
            index.ivf_base.nprobe = int(meta["nprobe"])
            index.rerank = int(meta["rerank"])
            index.filter_nprobe, index.filter_rerank = int(meta["filter_nprobe"]), int(meta["filter_rerank"])
            index.subset_row_s, index.probe_list_s = float(meta["subset_row_s"]), float(meta["probe_list_s"])
        else:
            assert flat is not None  # consistent
            index._flat = flat
        del ivf_bytes, subset_bytes
        index._ids = np.ascontiguousarray(ids, np.int64)
        index._size = count
        index._index_rows()
        return index, meta


def _read_in_place(buffer: np.ndarray) -> faiss.Index:
    """A serialized FAISS index whose codes (flat codes, inverted lists) are read in place from `buffer`, which must
    outlive it (IO_FLAG_MMAP_IFC on a zero-copy reader: FAISS's own mapping, by buffer rather than file name)."""
    reader = faiss.ZeroCopyIOReader(faiss.swig_ptr(buffer), buffer.nbytes)  # type: ignore[attr-defined]  # not in faiss's stubs
    return faiss.read_index(reader, faiss.IO_FLAG_MMAP_IFC)


def _legacy_index_meta(tensors: dict[str, np.ndarray], raw: dict[str, str]) -> dict | None:
    """The metadata of an index file written before the derived-file format (its checksum: ids, IVF and subset codes'
    bytes), if it verifies. Read so that an upgrade serves the old files until they are next written."""
    try:
        meta = json.loads(raw["zoo"])
    except (KeyError, ValueError):
        return None
    h = hashlib.sha256(np.ascontiguousarray(tensors.get("ids"), np.int64).tobytes())
    for part in (tensors.get("ivf"), tensors.get("subset")):
        if part is not None:
            h.update(np.ascontiguousarray(part).tobytes())
    return meta if isinstance(meta, dict) and meta.pop("checksum", None) == h.hexdigest() else None
