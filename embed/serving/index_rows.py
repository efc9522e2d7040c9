"""The rows of an embedder's index (embed/serving/index.py `AdapterIndex`): unit vectors by adapter id in a store of their own
(a float32 array when flat; an IVF's scalar-quantizer store and its subset codes otherwise), the sorted id → row
lookup, and the writes (add, replace, remove) that keep them in step. How it searches is embed/serving/index.py."""

from __future__ import annotations

import threading
import time
from typing import cast

import faiss
import numpy as np

from embed.serving.exact_search import normalize
from embed.serving.lookup import RowLookup

#: an IVF store's kinds (the FAISS scalar quantizer of each)
STORE_TYPES = {"8-bit": faiss.ScalarQuantizer.QT_8bit_uniform, "fp16": faiss.ScalarQuantizer.QT_fp16}
#: from this dimension on, an IVF index's store holds one byte a dimension (QT_8bit_uniform), below it float16
STORE_8BIT_FROM_DIM = 512
#: the 8-bit store's range is the training sample's widened by this share of it on each side, so that later vectors
#: slightly past the sample's extremes are not clipped
STORE_RANGE_MARGIN = 0.05


def trained_store(sample: np.ndarray, store: str | None = None) -> faiss.IndexScalarQuantizer:
    """An IVF index's empty store, '8-bit' or 'fp16' (default: by the dimension, STORE_8BIT_FROM_DIM), trained on
    `sample`. The 8-bit range is symmetric about 0: ±(the sample's largest coordinate in magnitude, widened by
    STORE_RANGE_MARGIN of the sample's range), so that 0 is a code's value and an absent module's zero block is
    stored exactly (IndexRows.add keeps any other coordinate off that code: module presence reads true)."""
    dim = int(sample.shape[1])
    store = store or ("8-bit" if dim >= STORE_8BIT_FROM_DIM else "fp16")
    if store not in STORE_TYPES:
        raise ValueError(f"store {store!r}: expected one of {sorted(STORE_TYPES)}")
    index = faiss.IndexScalarQuantizer(dim, STORE_TYPES[store], faiss.METRIC_INNER_PRODUCT)
    index.sq.rangestat, index.sq.rangestat_arg = faiss.ScalarQuantizer.RS_minmax, STORE_RANGE_MARGIN
    index.train(sample)
    if store == "8-bit":
        low, width = faiss.vector_to_array(index.sq.trained).astype(np.float64)
        half = np.float32(max(-low, low + width))
        faiss.copy_array_to_vector(np.array([-half, 2 * half], np.float32), index.sq.trained)
    return index


def store_step(store: faiss.IndexScalarQuantizer) -> float:
    """An 8-bit store's step: its range / 255 (a coordinate in the range is decoded within half a step)."""
    return float(faiss.vector_to_array(store.sq.trained)[1]) / 255


class IndexRows:
    """One embedder's unit vectors by adapter id, row per vector.

    Rows are numbered in insertion order; `_ids[row]` is the adapter id, and the sorted ids with their
    rows give the reverse.
    Flat: the store is a float32 array. IVF: a FAISS `IndexRefine` whose base is the IVF over the
    codes (FAISS ids = rows) and whose refine index, a scalar quantizer (8-bit or float16 codes), is the store.
    """

    def __init__(self, dim: int, ivf: faiss.IndexRefine | None = None) -> None:
        self.dim = dim
        self._ivf = ivf
        self._subset: faiss.IndexPQ | None = None  # the IVF kind's subset codes, row order
        self._ids = np.zeros(0, np.int64)
        self._flat = np.zeros((0, dim), np.float32)  # the flat kind's store
        self._size = 0
        self._lookup = RowLookup(self._ids)
        self._lock = threading.Lock()
        #: the file's parts the IVF and subset codes were read in place from (`load`), until a write copies them
        self.mapped_parts: dict[str, np.ndarray] | None = None
        #: seconds each step of building it took (train_ivf_s, train_store_s, train_subset_s, add_s, tune_s)
        self.timings: dict[str, float] = {}

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

    def _store_input(self, vectors: np.ndarray) -> np.ndarray:
        """Vectors as the store takes them. Where 0 is an 8-bit code's value (a range symmetric about 0:
        trained_store), a nonzero coordinate within a step of 0 is stored as ± a step, the next code's value: only a
        zero is stored as 0, so a sketch's absent modules (zero blocks) read as absent, and no others."""
        if self.store != "8-bit":
            return vectors
        low, width = faiss.vector_to_array(self.store_quantizer.sq.trained)
        if low != -width / 2:  # trained before ranges were symmetric: no code is 0
            return vectors
        step = width / 255
        near = (vectors != 0) & (np.abs(vectors) < step)  # ± a step is mid-code: no float rounding takes it to 0's code
        if not near.any():
            return vectors
        return np.where(near, np.copysign(np.float32(step), vectors), vectors).astype(np.float32)

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
                self.store_quantizer.add(self._store_input(vectors))
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
                    self.store_codes()[rows[old]] = self.store_quantizer.sa_encode(self._store_input(vectors[old]))
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
