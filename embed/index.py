"""The vectors of one embedder: stored by adapter id, searchable by cosine.

An `AdapterIndex` keeps every unit vector in a store of its own (a numpy array, row per adapter,
with a sorted id → row lookup), so re-ranking and filtered search read stored vectors by id and
never re-embed. How it searches depends on its size:
- below `IVF_FROM` vectors it is **flat**: exact cosine by brute force over the float32 store
  (`faiss.knn`, or `faiss.knn_gpu` when a GPU is present);
- from there on it is an **inverted file** (`IndexIVF`, ids = adapter ids) over compressed codes,
  with the store compressed too: by default at d ≥ 512 one byte a dimension (a quarter of float32; one
  range for every dimension, trained on the sample; a cosine with a unit query is off by (range / 255) / √12
  in standard deviation, 3.9e-4 on Llama-3-8B's 2,016-dimensional module sketches), below that float16 (a cosine
  off by ~1e-5; the W2T embedding's neighbours can be that close). 8 bits reorder neighbours closer than
  their error, so an index whose cosines are a search's final scores keeps float16 (embed/index_files.py STORE);
  one that only nominates candidates loses nothing measurable with 8 bits. The codes follow the
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

from embed.lookup import RowLookup
from zoo.files import read_derived, read_derived_mapped, write_derived

IVF_FROM = 100_000
#: the first stage hands this many candidates to the exact re-ranking
CANDIDATES = 200
#: an IVF index's nprobe is the smallest that puts this share of the exact top 10 among its CANDIDATES
RECALL_GOAL = 0.98
NPROBES = (4, 8, 16, 32, 64, 128, 256)
#: exact scores within this of the k-th are ties when nprobe is tuned: at least what the float16 store rounds a cosine by,
#: so which of them is "the" k-th is decided by rounding (a space of near-copies has hundreds within it); an 8-bit
#: store's ties are wider (`AdapterIndex.tie`)
TIE = 1e-4
#: from this dimension on, an IVF index's store holds one byte a dimension (QT_8bit_uniform), below it float16
STORE_8BIT_FROM_DIM = 512
#: the 8-bit store's range is the training sample's widened by this share of it on each side, so that later vectors
#: slightly past the sample's extremes are not clipped
STORE_RANGE_MARGIN = 0.05
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
#: an IVF store's kinds (the FAISS scalar quantizer of each)
STORE_TYPES = {"8-bit": faiss.ScalarQuantizer.QT_8bit_uniform, "fp16": faiss.ScalarQuantizer.QT_fp16}
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


def normalize(vectors: np.ndarray) -> np.ndarray:
    v = np.ascontiguousarray(vectors, dtype=np.float32)
    if v.ndim == 1:
        v = v[None, :]
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    return v / np.maximum(norms, 1e-12)


def trained_store(sample: np.ndarray, store: str | None = None) -> faiss.IndexScalarQuantizer:
    """An IVF index's empty store, '8-bit' or 'fp16' (default: by the dimension, STORE_8BIT_FROM_DIM), trained on
    `sample` (the 8-bit range: its smallest and largest coordinate, widened by STORE_RANGE_MARGIN)."""
    dim = int(sample.shape[1])
    store = store or ("8-bit" if dim >= STORE_8BIT_FROM_DIM else "fp16")
    if store not in STORE_TYPES:
        raise ValueError(f"store {store!r}: expected one of {sorted(STORE_TYPES)}")
    index = faiss.IndexScalarQuantizer(dim, STORE_TYPES[store], faiss.METRIC_INNER_PRODUCT)
    index.sq.rangestat, index.sq.rangestat_arg = faiss.ScalarQuantizer.RS_minmax, STORE_RANGE_MARGIN
    index.train(sample)
    return index


def store_step(store: faiss.IndexScalarQuantizer) -> float:
    """An 8-bit store's step: its range / 255 (a coordinate in the range is decoded within half a step)."""
    return float(faiss.vector_to_array(store.sq.trained)[1]) / 255


def gpu_available() -> bool:
    return hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0


_GPU_LOCK = threading.Lock()


@functools.cache
def _gpu_resources() -> faiss.StandardGpuResources:
    return faiss.StandardGpuResources()


class AdapterIndex:
    """One embedder's unit vectors by adapter id, searchable by cosine (flat or IVF, see the module doc).

    Rows are numbered in insertion order; `_ids[row]` is the adapter id, and the sorted ids with their
    rows give the reverse.
    Flat: the store is a float32 array. IVF: a FAISS `IndexRefine` whose base is the IVF over the
    codes (FAISS ids = rows) and whose refine index, a scalar quantizer (8-bit or float16 codes), is the store.
    """

    def __init__(self, dim: int, ivf: faiss.IndexRefine | None = None) -> None:
        self.dim = dim
        self._ivf = ivf
        self.rerank = CANDIDATES
        self.filter_nprobe = faiss.extract_index_ivf(ivf.base_index).nlist if ivf is not None else 0
        self._subset: faiss.IndexPQ | None = None  # the IVF kind's subset codes, row order
        self.filter_rerank = RERANKS[-1]
        self.subset_row_s = np.inf  # measured cost of the subset way per allowed row, and of the probe way per list
        self.probe_list_s = 0.0
        self._ids = np.zeros(0, np.int64)
        self._flat = np.zeros((0, dim), np.float32)  # the flat kind's store
        self._size = 0
        self._lookup = RowLookup(self._ids)
        self._lock = threading.Lock()
        #: the file's parts the IVF and subset codes were read in place from (`load`), until a write copies them
        self.mapped_parts: dict[str, np.ndarray] | None = None
        #: seconds each step of building it took (train_ivf_s, train_store_s, train_subset_s, add_s, tune_s)
        self.timings: dict[str, float] = {}

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
        obj.tune_nprobe(vectors[rng.choice(len(vectors), size=min(len(vectors), 200), replace=False)])
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

    # -- what it holds -------------------------------------------------------------------------

    @property
    def kind(self) -> str:
        return "ivf" if self.ivf else "flat"

    @property
    def ivf(self) -> bool:
        return self._ivf is not None

    @property
    def _refine(self) -> faiss.IndexRefine:
        """The IVF kind's FAISS index (the flat kind has none)."""
        assert self._ivf is not None
        return self._ivf

    def _subset_input(self, vectors: np.ndarray) -> np.ndarray:
        """Vectors as the subset codes take them: padded with zeros to their dimension (SUBSET_DIMS_PER_BYTE; an index
        saved before the padding has none)."""
        pad = int(self.subset_index.d) - vectors.shape[1]
        return np.ascontiguousarray(np.pad(vectors, ((0, 0), (0, pad))) if pad else vectors, np.float32)

    @property
    def subset_index(self) -> faiss.IndexPQ:
        """The IVF kind's subset codes (the flat kind has none)."""
        assert self._subset is not None
        return self._subset

    # downcast_index returns the index as its own class, typed in faiss's stubs as any Index
    @property
    def ivf_base(self) -> faiss.IndexIVF:
        return cast(faiss.IndexIVF, faiss.downcast_index(self._refine.base_index))

    @property
    def store_quantizer(self) -> faiss.IndexScalarQuantizer:
        return cast(faiss.IndexScalarQuantizer, faiss.downcast_index(self._refine.refine_index))

    @property
    def codes(self) -> str | None:
        """The IVF's codes: 'pq4 fast-scan' or 'fp16'; None when flat."""
        if self._ivf is None:
            return None
        return "pq4 fast-scan" if isinstance(self.ivf_base, faiss.IndexIVFPQFastScan) else "fp16"

    @property
    def store(self) -> str | None:
        """The IVF's store (the re-rank copy): '8-bit' or 'fp16'; None when flat (float32)."""
        if self._ivf is None:
            return None
        qtype = self.store_quantizer.sq.qtype
        return next(name for name, q in STORE_TYPES.items() if q == qtype)

    @property
    def store_bytes(self) -> int:
        """Bytes a vector takes in the store."""
        return 4 * self.dim if self._ivf is None else int(self.store_quantizer.code_size)

    @property
    def tie(self) -> float:
        """Exact scores this close to the k-th are ties when nprobe is tuned: TIE, or for an 8-bit store two standard
        deviations of its error in a cosine with a unit query, 2 · step / √12 (a coordinate rounded to a step of the
        range / 255 is off by a uniform error of ± step / 2)."""
        if self.store != "8-bit":
            return TIE
        return max(TIE, 2 * store_step(self.store_quantizer) / np.sqrt(12))

    @property
    def nprobe(self) -> int | None:
        return int(self.ivf_base.nprobe) if self._ivf is not None else None

    @property
    def size(self) -> int:
        """Vectors held (rows of removed adapters not counted)."""
        return self._lookup.size

    @property
    def ids(self) -> np.ndarray:
        ids = self._ids[: self._size]
        return ids[ids >= 0]

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """Store rows of these ids; -1 where an id is absent."""
        return self._lookup(ids)

    def _index_rows(self) -> None:
        self._lookup = RowLookup(self._ids[: self._size])

    def contains(self, adapter_id: int) -> bool:
        return bool(self.rows_of(np.array([adapter_id], np.int64))[0] >= 0)

    def vectors(self, ids: np.ndarray) -> np.ndarray:
        """(len(ids), dim) float32 stored unit vectors of these adapter ids (KeyError for one not in the index)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        rows = self.rows_of(ids)
        if (rows < 0).any():
            raise KeyError(f"adapters not in the index: {ids[rows < 0][:5].tolist()}")
        return self._at(rows)

    def _at(self, rows: np.ndarray) -> np.ndarray:
        if self._ivf is None:
            return self._flat[rows]
        if len(rows) <= 1000:  # FAISS decodes few rows faster by id; many faster gathered by numpy and decoded at once
            return (
                self.store_quantizer.reconstruct_batch(np.ascontiguousarray(rows, np.int64))
                if len(rows)
                else np.zeros((0, self.dim), np.float32)
            )
        return self.store_quantizer.sa_decode(np.ascontiguousarray(self.store_codes()[rows]))

    def store_codes(self) -> np.ndarray:
        """The IVF store's codes as a writable (size, bytes per vector) array, in place."""
        codes = faiss.rev_swig_ptr(self.store_quantizer.codes.data(), self.store_quantizer.codes.size())
        return np.frombuffer(codes, dtype=np.uint8).reshape(-1, self.store_quantizer.code_size)

    def subset_codes(self) -> np.ndarray:
        """The subset codes as a writable (size, bytes per code) array, in place."""
        sub = self.subset_index
        codes = faiss.rev_swig_ptr(sub.codes.data(), sub.codes.size())
        return np.frombuffer(codes, dtype=np.uint8).reshape(-1, sub.code_size)

    def _ids_of(self, rows: np.ndarray) -> np.ndarray:
        """Adapter ids of store rows, -1 where FAISS padded with -1."""
        return np.where(rows >= 0, self._ids[np.maximum(rows, 0)], -1)

    # -- writes --------------------------------------------------------------------------------

    def add(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Add new ids (ValueError for one already present)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if not len(ids):
            return
        vectors = normalize(vectors)
        if vectors.shape != (len(ids), self.dim):
            raise ValueError(f"expected {len(ids)} vectors of dimension {self.dim}, got {vectors.shape}")
        t0 = time.perf_counter()
        with self._lock:
            present = ids[self.rows_of(ids) >= 0].tolist()
            if present or len(np.unique(ids)) != len(ids):
                raise ValueError(f"ids already in the index: {present[:5] or 'repeated in the batch'}")
            self._own()
            start = self._size
            self._grow(start + len(ids))
            self._ids[start : start + len(ids)] = ids
            if self._ivf is None:
                self._flat[start : start + len(ids)] = vectors
            else:
                self.ivf_base.add_with_ids(vectors, np.arange(start, start + len(ids), dtype=np.int64))
                self.store_quantizer.add(vectors)
                self.subset_index.add(self._subset_input(vectors))
                self._ivf.ntotal = self.store_quantizer.ntotal
            self._size = start + len(ids)
            self._index_rows()
        self.timings["add_s"] = self.timings.get("add_s", 0.0) + time.perf_counter() - t0

    @property
    def mapped(self) -> bool:
        """Whether the IVF's codes and store and the subset codes are read in place from the index file (`load`): their
        pages are then the page cache's, resident in the process only where touched (module doc)."""
        return self.mapped_parts is not None

    def _own(self) -> None:
        """Before a write: copy the parts mapped from the file into memory of the index's own (a mapped part is
        read-only, and the file may be replaced)."""
        if self.mapped_parts is None:
            return
        nprobe = self.ivf_base.nprobe
        self._ivf = cast(faiss.IndexRefine, faiss.deserialize_index(np.array(self.mapped_parts["ivf"])))
        self._subset = cast(faiss.IndexPQ, faiss.deserialize_index(np.array(self.mapped_parts["subset"])))
        self.ivf_base.nprobe = nprobe
        self.mapped_parts = None

    def _grow(self, need: int) -> None:
        """Room for `need` rows, growing by half again (amortized O(1) per vector)."""
        if need <= len(self._ids):
            return
        capacity = max(need, int(len(self._ids) * 1.5), 1024)
        grown_ids = np.zeros(capacity, np.int64)
        grown_ids[: self._size] = self._ids[: self._size]
        self._ids = grown_ids
        if self._ivf is None:
            grown = np.zeros((capacity, self.dim), np.float32)
            grown[: self._size] = self._flat[: self._size]
            self._flat = grown

    def upsert(self, ids: np.ndarray, vectors: np.ndarray) -> None:
        """Add vectors, replacing those of ids already present (a re-embedded adapter)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if not len(ids):
            return
        vectors = normalize(vectors)
        rows = self.rows_of(ids)
        old = rows >= 0
        if old.any():
            with self._lock:
                self._own()
                if self._ivf is None:
                    self._flat[rows[old]] = vectors[old]
                else:
                    self.ivf_base.remove_ids(rows[old])  # type: ignore[arg-type]  # ids as an array: faiss's wrapper takes them, its stubs not
                    self.ivf_base.add_with_ids(vectors[old], rows[old])
                    self.store_codes()[rows[old]] = self.store_quantizer.sa_encode(vectors[old])
                    self.subset_codes()[rows[old]] = self.subset_index.sa_encode(self._subset_input(vectors[old]))
        self.add(ids[~old], vectors[~old])

    def remove(self, ids: np.ndarray) -> None:
        """Drop these ids (deleted adapters; absent ones are ignored). Flat: the rows are compacted. IVF:
        they leave the inverted lists, and their store rows stay, dead (-1 ids), until a rebuild."""
        rows = self.rows_of(np.ascontiguousarray(ids, dtype=np.int64))
        rows = np.unique(rows[rows >= 0])
        if not len(rows):
            return
        with self._lock:
            self._own()
            if self._ivf is None:
                keep = np.setdiff1d(np.arange(self._size), rows)
                self._flat[: len(keep)] = self._flat[keep]
                self._ids[: len(keep)] = self._ids[keep]
                self._size = len(keep)
            else:
                self.ivf_base.remove_ids(faiss.IDSelectorBatch(rows))
                self._ids[rows] = -1
            self._index_rows()

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

    def tune_nprobe(self, queries: np.ndarray, k: int = 10, max_nprobe: int | None = None) -> float:
        """Set (nprobe, rerank): for each re-rank depth in RERANKS the smallest nprobe in NPROBES whose
        `rerank` nearest by the codes hold RECALL_GOAL of the exact top k (brute force over the store),
        then of those the pair whose whole search (codes and re-ranking) is fastest on these queries;
        every list (at most `max_nprobe`) and the deepest re-rank when none reaches the goal. Returns the recall of
        the pair."""
        if self._ivf is None:
            return 1.0
        t0 = time.perf_counter()
        q = normalize(queries)
        exact = TiedTop(*self.exact_top(q, TIE_DEPTH), k, self.tie)
        base = self.ivf_base
        most = min(base.nlist, max_nprobe or base.nlist)
        ladder = [p for p in NPROBES if p < most] + [most]
        viable: list[tuple[float, int, int, float]] = []

        def recall_of(nprobe: int, rerank: int) -> float:
            base.nprobe = nprobe
            found = base.search(q, min(rerank, self._size))[1]
            return exact.recall(self._ids_of(found))

        for rerank in RERANKS:
            for nprobe in ladder:
                recall = recall_of(nprobe, rerank)
                if recall >= RECALL_GOAL:
                    self.rerank = rerank
                    t0 = time.perf_counter()
                    for row in q:
                        self.search(row[None, :], CANDIDATES)
                    viable.append((time.perf_counter() - t0, nprobe, rerank, recall))
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


def brute_force(ids: np.ndarray, vectors: np.ndarray, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The numpy reference: exact cosine top-k."""
    sims = normalize(queries) @ normalize(vectors).T
    order = np.argsort(-sims, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(sims, order, axis=1), np.asarray(ids, dtype=np.int64)[order]


class TiedTop:
    """The exact top k of some queries with their ties: the neighbours scoring more than `tie` above the k-th must be
    found themselves; the rest of the k may be any adapters whose exact score is within `tie` of the k-th's."""

    def __init__(self, scores: np.ndarray, ids: np.ndarray, k: int, tie: float = TIE) -> None:
        kth = scores[:, k - 1 : k]
        self.k = k
        self.above = [set(row[s > t + tie].tolist()) for row, s, t in zip(ids, scores, kth, strict=True)]
        self.tied = [set(row[np.abs(s - t) <= tie].tolist()) for row, s, t in zip(ids, scores, kth, strict=True)]

    def recall(self, found: np.ndarray) -> float:
        """Mean share of the k that `found` (ids per query, -1 pads) holds, a tie of the k-th standing for any other."""
        shares = []
        for row, above, tied in zip(found, self.above, self.tied, strict=True):
            got = set(row.tolist())
            shares.append((len(above & got) + min(self.k - len(above), len(tied & got))) / self.k)
        return float(np.mean(shares))


def recall_at_k(approx_ids: np.ndarray, exact_ids: np.ndarray) -> float:
    hits = [len(set(a.tolist()) & set(e.tolist())) / max(1, len(e)) for a, e in zip(approx_ids, exact_ids, strict=True)]
    return float(np.mean(hits)) if hits else 1.0
