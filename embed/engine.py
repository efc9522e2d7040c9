"""The query engine: similar-adapter search and prediction at O(k) per query, one engine per process.

Per embedding space it holds, loaded once:
- each active embedder's FAISS index (embed/index.py), from its file under `DATA/index/`, with
  every vector reachable by id: re-ranking reads stored vectors and never re-embeds;
- the supervised W2T ensemble (for the query's own vector and for predictions);
- the module store: every adapter's canonical factors as one `ModuleStack` (`DATA/rerank/`),
  for the exact module-cosine stage. `zoo embed` writes it while it fits `module_store_budget()`;
  a space without one scores module cosine from the stored module sketches instead.

It learns of new embeddings from the space's version (zoo/store/spaces.py): one indexed query per
request; when the version moved, it loads only the rows stamped after the version it has and adds
them to the indexes (and their factors to the module store), and drops the adapters deleted since (their
tombstones) from everything it holds by id: indexes, module store, names and labels. Ids are never reused
(migration 0011), so nothing held for a deleted adapter can be served under a later one's id.

Index files and module stores are this node's caches: one the data dir lacks (a new node's empty disk, a space
embedded on another node) is built from the database (and the module store's factors from the blob store) when
the space is first loaded, kept, and logged with the seconds it took. Otherwise it never rebuilds an index inside
a query: an index file that is corrupt or disagrees with the database is reported and the query is answered from
the database's vectors (exact, in memory) while they are few, or refused with the command to run. Searches run
concurrently; a refresh takes the space's write lock.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import faiss
import numpy as np

from embed.attributes import AdapterAttributes
from embed.budgets import embed_chunk_bytes, module_store_budget, spaces_budget
from embed.calibration import is_sure
from embed.checkpoint import channel_metrics_of, checkpoint_meta, search_of
from embed.dense_svd import DenseSVD
from embed.gram_sketch import gram_sketches
from embed.index import CANDIDATES, IVF_FROM, AdapterIndex, ivf_lists
from embed.knn import knn_shares, knn_value, neighbour_classes
from embed.metrics import top_k
from embed.results import ClassGuess, Confidence, Found, Hit, MetricGuess, Neighbour, Predicted, Query
from embed.rwlock import RWLock
from embed.types import SpaceSchema, ZooAdapter
from zoo.domain.channel_metric import ChannelMetric
from zoo.domain.channels import EXACT_SCORES, exact_cosines
from zoo.domain.methods import KnnPredictor, SearchScore, fitted_purpose
from zoo.domain.similarity import ModuleStack, dense_modules, module_sketches, sketch_module_cosines

if TYPE_CHECKING:
    from embed.ensemble import W2TEnsemble
    from zoo.domain.canonical import CanonicalFactors
    from zoo.store.blobs import BlobStore
from zoo.errors import NotReadyError, StorageError, UsageError
from zoo.files import read_derived, write_derived, write_derived_in_place
from zoo.limits import MAX_K
from zoo.store import repository
from zoo.store.embedders import get_embedder, serving_embedders
from zoo.store.embeddings import deleted_since, embedded_ids, embedding_ids, iter_embeddings, load_embeddings, stored_count
from zoo.store.filters import label_key
from zoo.store.label_reads import last_label_id
from zoo.store.models import Embedder, EmbeddingSpace
from zoo.store.session import Session, Sessions, read_snapshot
from zoo.store.space_adapters import factor_digests, module_ranks
from zoo.store.spaces import get_space, get_space_by_id, space_version

SKETCH = "module_sketch"
W2T = "w2t"
#: the raw-factor sketches (zoo.domain.factorwise.raw_sketches): how much two adapters share their factors as their
#: files had them, which the relation step reads for merges PEFT made factor by factor and for continuations
RAW = "raw_factors"
#: the input-Gram sketches (zoo.domain.channels.channel_sketches, "input_gram"): per module seeded bilinear probes of
#: dWᵀdW = V S² Vᵀ, whose inner products estimate the input Gram cosine; the first stage of input_gram search
GRAM = "input_gram_sketch"
#: hybrid: the search score `zoo train` chose out of fold (embed/choice.py): an exact score (dw, module or
#: input_gram) mixed with the supervised W2T cosine by the chosen weight (0: the exact score alone), over the union
#: of the CANDIDATES nearest of the indexes it weighs (EXACT_CANDIDATES, W2T); module, dw and input_gram: the
#: CANDIDATES nearest of their sketch indexes ranked by the mean module cosine, the whole update's cosine or the mean
#: input Gram cosine; sketch and w2t: their embeddings alone (their CANDIDATES nearest re-ranked by the stored
#: vectors); raw: the raw-factor sketches alone, for stored adapters.
SEARCH_METHODS = ("hybrid", "module", "dw", "input_gram", "sketch", "w2t", "raw")
#: per method, the embedders it needs (an exact score's candidates are re-ranked from the module store, and the module
#: sketch stands in for its other candidate indexes where the space lacks them: EXACT_CANDIDATES)
METHOD_EMBEDDERS = {"hybrid": (SKETCH, W2T), **dict.fromkeys(EXACT_SCORES, (SKETCH,)), "sketch": (SKETCH,), "w2t": (W2T,), "raw": (RAW,)}
#: per exact score, the indexes whose CANDIDATES nearest are its first-stage candidates, where the space has them (one
#: embedded before the input-Gram sketches has none until `zoo embed` runs):
#: the input Gram's true neighbours (an adapter whose head was re-seeded: dW → Q·dW) need not be near in the module
#: sketch. On digits-vit-seeded (300 adapters, `python -m bench.search --zoo-data-dir`) the CANDIDATES nearest held
#: 0.609 of the exact input-Gram top 10 from the module sketch index, 0.965 from the input-Gram sketch index and 0.988
#: from both (docs/results.md)
EXACT_CANDIDATES = {"dw": (SKETCH,), "module": (SKETCH,), "input_gram": (GRAM, SKETCH)}
#: a channel metric's first-stage candidates (embed/fitted.py): it weighs the input Gram, dW and module cosine as the
#: labels ask, so both indexes' nearest
FITTED_CANDIDATES = (GRAM, SKETCH)
#: the most lists an IVF index of these embedders probes: raw-factor sketches of unrelated adapters are near-random
#: vectors (independent inits), so no nprobe holds the exact top 10 of a query without relatives (a million synthetic
#: ones tuned to every list: 99 ms a query); the relation step wants only relatives, which share the query's lists
MAX_NPROBE = {RAW: 32}
#: an IVF index's store (its re-rank copy, whose cosines are the scores) where not the default by dimension (8-bit from
#: embed/index.py STORE_8BIT_FROM_DIM): the input-Gram sketches keep float16, as the default search's scores are their
#: cosines and an 8-bit store's error reorders a top 10 (Llama-3-8B's, 50,000 mixed from 200 real: 6.5e-4 in a cosine
#: against a median gap of 1.6e-4 between the 10th and 11th; recall@10 of the exact top 10 0.879, float16 0.996), while
#: the 200 nearest of an 8-bit store still hold all of it (1.000): the module sketch's job in that search
STORE = {GRAM: "fp16"}
#: the embedder whose vectors each method's own scores are (the others score through exact cosines or the hybrid)
VECTOR_SCORES = {"sketch": SKETCH, "w2t": W2T, "raw": RAW}
#: labelled neighbours counted as support of an attribute predicted by something other than a kNN
SUPPORT_K = 5


def index_path(data_dir: Path, embedder_id: int) -> Path:
    return data_dir / "index" / f"embedder-{embedder_id}.index"


def module_store_path(data_dir: Path, space_id: int) -> Path:
    return data_dir / "rerank" / f"space-{space_id}.safetensors"


log = logging.getLogger(__name__)

# --- index and module-store files (written by `zoo embed` and `zoo index rebuild`) ---------------


def update_index_file(session: Session, data_dir: Path, embedder: Embedder, rebuild: bool = False) -> tuple[AdapterIndex, str]:
    """Bring the embedder's index file up to the database: add the rows written since it was saved, or
    build it from every row (asked, none yet, or the file disagreed). Returns (index, how)."""
    version = space_version(session, embedder.space_id)
    path = index_path(data_dir, embedder.id)
    how = "rebuilt (asked)" if rebuild else "built"
    if path.exists() and not rebuild:
        try:
            index, meta = load_consistent_index(session, path, embedder, version)
            if index.ivf != (index.size >= IVF_FROM):
                how = f"rebuilt ({index.size} vectors outgrew its {index.kind} kind)"
            elif meta["version"] == version:
                return index, "loaded"
            else:
                index.save(path, {"embedder_id": embedder.id, "version": version})
                return index, "updated"
        except ValueError:
            how = "rebuilt (the file disagreed with the database)"
    index = build_index(session, embedder)
    index.save(path, {"embedder_id": embedder.id, "version": version})
    return index, how


#: vectors read from the database at a time while an index is built (bytes)
BUILD_CHUNK_BYTES = 64 << 20


def build_index(session: Session, embedder: Embedder, ivf: bool | None = None) -> AdapterIndex:
    """The embedder's index built from its stored vectors a chunk of BUILD_CHUNK_BYTES at a time: an IVF's quantizer
    and codes are trained on a sample read by id (as AdapterIndex.build draws it), so memory is the index plus one
    chunk, never every vector in float32 (1M Llama-3-8B sketches: 8 GB)."""
    ids = embedding_ids(session, embedder)
    if ivf is None:
        ivf = len(ids) >= IVF_FROM
    if not ivf or not len(ids):
        index = AdapterIndex.exact(embedder.dim)
    else:
        rng = np.random.default_rng(0)
        _, sample = load_embeddings(session, embedder, ids=rng.choice(ids, size=min(len(ids), 64 * ivf_lists(len(ids))), replace=False))
        index = AdapterIndex.trained_ivf(sample, len(ids), store=STORE.get(embedder.method))
        del sample
    per_chunk = max(1, BUILD_CHUNK_BYTES // (4 * embedder.dim))
    for chunk_ids, vectors in iter_embeddings(session, embedder, ids=ids, batch=per_chunk):
        index.add(chunk_ids, vectors)
    if index.ivf:
        _, tune = load_embeddings(session, embedder, ids=np.random.default_rng(0).choice(ids, size=min(len(ids), 200), replace=False))
        index.tune_nprobe(tune, max_nprobe=MAX_NPROBE.get(embedder.method))
    return index


def load_consistent_index(session: Session, path: Path, embedder: Embedder, version: int) -> tuple[AdapterIndex, dict]:
    """The index file plus the rows written after it; ValueError when it cannot be made to agree with the database."""
    index, meta = AdapterIndex.load(path)
    if meta.get("embedder_id") != embedder.id or int(meta.get("version", -1)) > version:
        raise ValueError(f"{path} was written for another database or embedder")
    index.remove(deleted_since(session, embedder.space_id, int(meta["version"])))  # before adding: an id may come back
    ids, vectors = load_embeddings(session, embedder, after_version=int(meta["version"]))
    index.upsert(ids, vectors)
    stored = stored_count(session, embedder.id)
    if index.size != stored:
        raise ValueError(f"{path} holds {index.size} vectors, the database {stored}")
    return index, meta


def update_module_store(session: Session, blobs: BlobStore, data_dir: Path, space: EmbeddingSpace, rebuild: bool = False) -> str:
    """Write the space's module store (every embedded adapter's factors) while it fits the budget."""
    sketch = serving_embedders(session, space.id).get(SKETCH)
    path = module_store_path(data_dir, space.id)
    if sketch is None:
        return "none (no module sketch embedder)"
    ids = sorted(embedded_ids(session, sketch))
    have = None if rebuild else read_module_store(path)
    dropped = 0
    if have is not None:  # rows of adapters deleted since it was written, or no longer embedded, leave it
        stale = stale_module_rows(session, space.id, have[0], have[3], np.array(ids, np.int64))
        if len(stale):
            keep = np.flatnonzero(~np.isin(have[0], stale))
            have, dropped = (have[0][keep], have[1].take(keep), have[2], have[3]), len(stale)
    known = set(have[0].tolist()) if have else set()
    new = [i for i in ids if i not in known]
    if have and not new and not dropped:
        return "loaded"
    layout = module_layout(session, space.base_model, SpaceSchema.from_dict(sketch.config["schema"]))
    estimate = len(ids) * layout_bytes(layout)
    if estimate > module_store_budget():  # known from the module table before any factors are read
        path.unlink(missing_ok=True)
        return _over_budget(estimate)
    if have and not set(have[1].norms) <= set(layout):
        have, new = None, ids  # modules the space no longer has: start again
    for name, (U, _, _) in have[1].factors.items() if have else ():
        out, inp, r = layout[name]
        layout[name] = (out, inp, max(r, U.shape[1]))
    dense = have[2] if have else {n for n, (o, i, r) in layout.items() if r and o * i <= 2 * r * (o + i)}
    start = have[1].size if have else 0
    all_ids = np.concatenate([have[0], np.array(new, dtype=np.int64)]) if have else np.array(new, dtype=np.int64)
    per_chunk = max(1, embed_chunk_bytes() // max(layout_bytes(layout), 1))

    def fill(arrays: dict[str, np.ndarray], release: Callable[[], None]) -> None:
        """The store filled in its file a chunk of adapters at a time, each chunk's pages let go once written: `zoo
        embed` holds one chunk, not the store (up to ZOO_MODULE_STORE_BYTES)."""
        nonlocal have
        arrays["ids"][:] = all_ids
        stack = ModuleStack.from_arrays({k: v for k, v in arrays.items() if k != "ids"}, len(all_ids))
        if have:
            have[1].copy_into(stack)
            have = None  # the store read back, let go
            release()
        for at in range(0, len(new), per_chunk):
            stack.fill(start + at, factors_of(session, blobs, new[at : at + per_chunk]))
            release()

    shapes = {**ModuleStack.shapes(len(all_ids), layout, dense), "ids": (len(all_ids),)}
    write_derived_in_place(path, shapes, {"version": space_version(session, space.id), "dense": sorted(dense)}, fill)
    how = "updated" if start else "built"
    return f"{how} ({dropped} deleted dropped)" if dropped else how


def module_layout(session: Session, base_model: str, schema: SpaceSchema) -> dict[str, tuple[int, int, int]]:
    """Per module of the space's vocabulary: (out, in, the largest canonical rank stored), from the module table."""
    known = set(schema.modules)
    return {n: (o, i, r) for n, o, i, r in module_ranks(session, base_model) if (n, o, i) in known}


def layout_bytes(layout: dict[str, tuple[int, int, int]]) -> int:
    """Bytes per adapter of a module store of this layout (ModuleStack's: per module its padded factors, or its
    flattened dW where that is smaller)."""
    elements = 0
    for out, inp, r in layout.values():
        if r:
            elements += 1 + (out * inp if out * inp <= 2 * r * (out + inp) else r * (out + inp + 1))
    return 4 * elements


def _nbytes(stack: ModuleStack) -> int:
    return sum(a.nbytes for a in stack.arrays().values())


def _over_budget(nbytes: float) -> str:
    return f"none ({nbytes / 2**30:.2f} GiB is over ZOO_MODULE_STORE_BYTES: module cosine comes from the module sketches)"


def factors_of(session: Session, blobs: BlobStore, ids: list[int]) -> list[dict[str, CanonicalFactors]]:
    digests = factor_digests(session, ids)
    return [dict(blobs.get_factors(str(digests[i]))) for i in ids]


def _stack_of(session: Session, blobs: BlobStore, ids: list[int], dense: set[str] | None) -> ModuleStack:
    factors = factors_of(session, blobs, ids)
    return ModuleStack.of(factors, dense if dense is not None else dense_modules(factors))


def write_module_store(path: Path, ids: np.ndarray, stack: ModuleStack, version: int) -> None:
    write_derived(path, {**stack.arrays(), "ids": np.asarray(ids, dtype=np.int64)}, {"version": version, "dense": sorted(stack.dense)})


def stale_module_rows(session: Session, space_id: int, ids: np.ndarray, version: int, embedded: np.ndarray) -> np.ndarray:
    """Ids of a module store written at `version` that it must not serve: adapters deleted since (their tombstones; an
    id is never reused, migration 0011, but a store written before that may hold one) or without a sketch vector now."""
    return ids[np.isin(ids, deleted_since(session, space_id, version)) | ~np.isin(ids, embedded)]


def read_module_store(path: Path) -> tuple[np.ndarray, ModuleStack, set[str], int] | None:
    """(ids, stack, dense modules, version), or None when the file is missing, unreadable or damaged."""
    try:
        tensors, meta = read_derived(path, "module store", legacy=_legacy_module_store_meta)
        ids = tensors.pop("ids")
        return ids, ModuleStack.from_arrays(tensors, len(ids)), set(meta["dense"]), int(meta["version"])
    except Exception:  # noqa: BLE001 - any unreadable file is treated as absent (and rebuilt by `zoo embed`)
        return None


def _legacy_module_store_meta(tensors: dict[str, np.ndarray], raw: dict[str, str]) -> dict | None:
    """The metadata of a module store written before the derived-file format (no checksum; version and dense modules
    as strings). Read so that an upgrade keeps exact re-ranking until the store is next written."""
    try:
        return {"version": int(raw["version"]), "dense": list(json.loads(raw["dense"]))}
    except (KeyError, TypeError, ValueError):
        return None


# --- the engine ----------------------------------------------------------------------------------


@dataclass
class LoadedEmbedder:
    id: int
    method: str
    objective: str | None
    checkpoint: str | None
    config: dict
    index: AdapterIndex
    state: str  # loaded | answered from the database (...)


@dataclass
class ModuleStore:
    """The exact stage's data: factors of the stored adapters, row per id, and the SVDs of their dense modules as
    queries first need them (`svd`, embed/dense_svd.py). Never changed in place: adding or dropping adapters makes a
    new store, which carries the SVDs of the rows it keeps."""

    stack: ModuleStack
    rows: dict[int, int]
    dense: set[str]
    svd: DenseSVD | None = None

    def __post_init__(self) -> None:
        if self.svd is None or self.svd.stack is not self.stack:
            self.svd = DenseSVD(self.stack)

    def take(self, ids: Sequence[int]) -> ModuleStack:
        """The stack of these stored adapters, in that order, with their dense modules' SVDs (`ModuleStack.svd`)."""
        assert self.svd is not None  # set by __post_init__
        return self.svd.take([self.rows[int(i)] for i in ids])

    def extended(self, ids: list[int], stack: ModuleStack) -> ModuleStore:
        start = self.stack.size
        rows = {**self.rows, **{i: start + j for j, i in enumerate(ids)}}
        grown = ModuleStack.concat([self.stack, stack])
        assert self.svd is not None
        source = np.concatenate([np.arange(start), np.full(stack.size, -1)])
        return ModuleStore(grown, rows, self.dense, self.svd.moved(grown, source))

    def without(self, ids: np.ndarray) -> ModuleStore:
        """The store without the rows of these ids (deleted adapters): itself when it holds none of them."""
        gone = {int(i) for i in np.asarray(ids).tolist()} & self.rows.keys()
        if not gone:
            return self
        kept = sorted((row, i) for i, row in self.rows.items() if i not in gone)
        source = np.array([row for row, _ in kept], dtype=np.int64)
        stack = self.stack.take(source)
        assert self.svd is not None
        return ModuleStore(stack, {i: j for j, (_, i) in enumerate(kept)}, self.dense, self.svd.moved(stack, source))


@dataclass
class SpaceState:
    id: int
    name: str
    base_model: str
    version: int
    embedders: dict[str, LoadedEmbedder]
    modules: ModuleStore | None
    attributes: AdapterAttributes
    lock: RWLock = field(default_factory=RWLock)

    @property
    def schema(self) -> SpaceSchema | None:
        sketch = self.embedders.get(SKETCH)
        return SpaceSchema.from_dict(sketch.config["schema"]) if sketch else None

    @property
    def default_method(self) -> str:
        w2t = self.embedders.get(W2T)
        return "hybrid" if w2t is not None and w2t.objective != "contrastive" else "module"


#: bytes per held adapter besides its vectors: an index's id and row lookup; a module store's row (a dict entry);
#: a name (a short str) and its row lookup
ID_BYTES, ROW_BYTES, NAME_BYTES = 16, 100, 112


def space_bytes(state: SpaceState) -> int:
    """The memory a loaded space holds, estimated from its parts: each index's vectors, the module store's arrays,
    rows and the most its dense modules' SVDs can take (DenseSVD.bound), the names and a label code per adapter and
    key. W2T models are held per process (`load_w2t`)."""
    total = sum(index_bytes(e.index) for e in state.embedders.values())
    if state.modules is not None:
        total += _nbytes(state.modules.stack) + DenseSVD.bound(state.modules.stack) + ROW_BYTES * len(state.modules.rows)
    attributes = state.attributes
    return total + len(attributes) * (NAME_BYTES + 4 * len(attributes.labels))


def index_bytes(index: AdapterIndex) -> int:
    """An index's vectors: float32 in a flat one; in an IVF one the store (8-bit or float16), the list codes (float16 or
    4-bit PQ) and the 8-bit subset codes (embed/index.py)."""
    if not index.ivf:
        return index.size * (index.store_bytes + ID_BYTES)
    codes = 2 * index.dim if index.codes == "fp16" else index.dim // 8
    return index.size * (index.store_bytes + codes + index.dim // 8 + ID_BYTES)


def _interval(value: float, std: float | None, lowest: float, highest: float) -> tuple[float, float] | tuple[None, None]:
    """A predicted metric's 90 % interval from its held-out residuals' std, within the metric's range; none without
    residuals (never NaN in JSON)."""
    if std is None or not math.isfinite(std):
        return None, None
    return max(value - 1.645 * std, lowest), min(value + 1.645 * std, highest)


@functools.lru_cache(maxsize=4)
def load_w2t(checkpoint: Path, device: str | None) -> W2TEnsemble:
    """A W2T checkpoint, loaded once per process (checkpoint directories are never rewritten)."""
    from embed.ensemble import W2TEnsemble

    return W2TEnsemble.load(checkpoint, device)


class QueryEngine:
    """Similar-adapter queries and predictions against one database and data dir; thread-safe."""

    def __init__(self, sessions: Sessions, blobs: BlobStore, data_dir: Path, device: str | None = None, module_stores: bool = True) -> None:
        """`module_stores`: whether spaces hold their module store (the exact stage). An engine that only finds stored
        adapters' neighbours by their vectors (the relation step's: `stored_neighbours`, `stored_vectors`) holds their
        indexes alone, not a module store of up to ZOO_MODULE_STORE_BYTES per space."""
        # one core per query: concurrency comes from the threads serving queries, and OpenMP teams spinning
        # against a busy second core cost 100x (flat search at 10k: 12.5 ms with 2 threads, 0.11 ms with 1)
        faiss.omp_set_num_threads(1)
        self.sessions = sessions
        self.blobs = blobs
        self.data_dir = Path(data_dir)
        self.device = device
        self.module_stores = module_stores
        self._spaces: OrderedDict[str, SpaceState] = OrderedDict()  # least recently used first
        self._bytes: dict[str, int] = {}  # space_bytes of each held state
        self._marks: dict[str, tuple[int, int, int]] = {}  # (version, label mark, module store) each was measured at
        self._lock = threading.Lock()

    # -- state ---------------------------------------------------------------------------------

    def space(self, session: Session, name: str) -> SpaceState:
        """The space's state, loaded on first use and brought up to the database's version. Loaded spaces are
        kept within `spaces_budget()`: the least recently used others are dropped when this one would pass it
        (a query holding a dropped state finishes on it; the next query of that space loads it again)."""
        with self._lock:
            state = self._spaces.get(name)
            if state is not None:
                self._spaces.move_to_end(name)
        if state is None:
            with self._snapshot() as snap:
                state = self._load(snap, get_space(snap, name))
            with self._lock:
                state = self._spaces.setdefault(name, state)
                self._spaces.move_to_end(name)
        self._refresh(session, state)
        self._account(name, state)
        return state

    def _account(self, name: str, state: SpaceState) -> None:
        """Record the state's bytes (again when it caught up with the database) and drop the least recently
        used other spaces while the loaded ones pass the budget."""
        mark = (state.version, state.attributes.mark, id(state.modules))
        if self._marks.get(name) == mark:
            return
        nbytes = space_bytes(state)
        budget = spaces_budget()
        with self._lock:
            if self._spaces.get(name) is not state:  # dropped (or replaced) meanwhile
                return
            self._bytes[name], self._marks[name] = nbytes, mark
            for other in [n for n in self._spaces if n != name]:  # least recently used first
                if sum(self._bytes.values()) <= budget:
                    break
                del self._spaces[other]
                self._bytes.pop(other, None)
                self._marks.pop(other, None)

    def loaded_spaces(self) -> dict[str, int]:
        """The spaces held now, least recently used first, with the bytes each is estimated to take."""
        with self._lock:
            return {name: self._bytes.get(name, 0) for name in self._spaces}

    def _load(self, session: Session, row: EmbeddingSpace) -> SpaceState:
        version = space_version(session, row.id)
        embedders: dict[str, LoadedEmbedder] = {}
        for method, e in serving_embedders(session, row.id).items():
            index, index_state = self._open_index(session, e, version)
            embedders[method] = LoadedEmbedder(e.id, e.method, e.objective, e.checkpoint, dict(e.config), index, index_state)
        modules = None
        store = module_store_path(self.data_dir, row.id)
        if self.module_stores and SKETCH in embedders and not store.exists():  # not in this node's cache: built from the blobs
            started = time.perf_counter()
            try:
                how = update_module_store(session, self.blobs, self.data_dir, row)
            except StorageError as exc:  # the blob store is down: module cosine from the sketches until a later load
                how = f"not built ({exc})"
            log.info("space %s: module store %s on this node in %.2f s (%s)", row.name, how, time.perf_counter() - started, store)
        have = read_module_store(store) if self.module_stores else None
        if have is not None and have[3] <= version and SKETCH in embedders:
            ids, stack, dense, _ = have
            modules = ModuleStore(stack, {int(i): j for j, i in enumerate(ids.tolist())}, dense)
            modules = modules.without(stale_module_rows(session, row.id, ids, have[3], embedders[SKETCH].index.ids))
        ids = np.unique(np.concatenate([np.zeros(0, np.int64), *(e.index.ids for e in embedders.values())]))
        attributes = AdapterAttributes.load(session, row.base_model, ids)
        state = SpaceState(row.id, row.name, row.base_model, version, embedders, modules, attributes)
        if modules is not None and have is not None and SKETCH in embedders:
            self._extend_modules(session, state, have[3])
        return state

    def _open_index(self, session: Session, embedder: Embedder, version: int) -> tuple[AdapterIndex, str]:
        path = index_path(self.data_dir, embedder.id)
        if not path.exists():  # not in this node's cache (a new node, a space embedded on another): built and kept
            started = time.perf_counter()
            index, _ = update_index_file(session, self.data_dir, embedder)
            seconds = time.perf_counter() - started
            log.info("embedder %d: index of %d vectors built on this node in %.2f s (%s)", embedder.id, index.size, seconds, path)
            return index, f"built on this node from the database in {seconds:.2f} s"
        try:
            index, _ = load_consistent_index(session, path, embedder, version)
            return index, "loaded"
        except ValueError as exc:
            problem = str(exc)
        count = stored_count(session, embedder.id)
        if count > IVF_FROM:
            raise NotReadyError(f"{problem}; run `zoo index rebuild` to rebuild it from the database")
        index = build_index(session, embedder, ivf=False)
        return index, f"answered from the database ({problem}); run `zoo index rebuild` to save an index"

    def _refresh(self, session: Session, state: SpaceState) -> None:
        """Catch up with the database: new embeddings (the space version moved), new labels (the last label id did)."""
        if space_version(session, state.id) == state.version and last_label_id(session) == state.attributes.mark:
            return
        with state.lock.write(), self._snapshot() as snap:
            version = space_version(snap, state.id)
            if version != state.version:
                self._catch_up(snap, state, version)
            state.attributes.refresh(snap)

    @contextmanager
    def _snapshot(self) -> Iterator[Session]:
        """A session of its own whose reads all see one snapshot of the database (PostgreSQL: REPEATABLE READ; a SQLite
        read transaction is one already), for loading a space and catching up: under READ COMMITTED each statement saw
        the commits made since the one before, so an adapter deleted between reading its embedding and its factors'
        digest failed the request (a KeyError, a 500) and the version read could disagree with the rows loaded."""
        with self.sessions() as session:
            yield read_snapshot(session)

    def _catch_up(self, session: Session, state: SpaceState, version: int) -> None:
        active = {m: e.id for m, e in serving_embedders(session, state.id).items()}
        if active != {m: e.id for m, e in state.embedders.items()}:  # an embedder was trained or replaced
            fresh = self._load(session, get_space_by_id(session, state.id))
            state.embedders, state.modules, state.attributes = fresh.embedders, fresh.modules, fresh.attributes
            state.version = fresh.version
            return
        deleted = deleted_since(session, state.id, state.version)
        if len(deleted):  # every structure keyed by adapter id drops them: indexes (below), module store, names and labels
            state.modules = state.modules.without(deleted) if state.modules is not None else None
            state.attributes.drop(deleted)
        for loaded in state.embedders.values():
            e = get_embedder(session, loaded.id)
            loaded.index.remove(deleted)  # before adding: an id may come back
            ids, vectors = load_embeddings(session, e, after_version=state.version)
            loaded.index.upsert(ids, vectors)
            state.attributes.add(session, ids.tolist())
        self._extend_modules(session, state, state.version)
        state.version = version

    def _extend_modules(self, session: Session, state: SpaceState, after_version: int) -> None:
        """Add the factors of adapters sketched after `after_version` to the module store."""
        if state.modules is None:
            return
        sketch = get_embedder(session, state.embedders[SKETCH].id)
        ids, _ = load_embeddings(session, sketch, after_version=after_version)
        new = [int(i) for i in ids.tolist() if int(i) not in state.modules.rows]
        if new:
            state.modules = state.modules.extended(new, _stack_of(session, self.blobs, new, state.modules.dense))

    # -- queries -------------------------------------------------------------------------------

    def similar(
        self, session: Session, space: str, query: Query, k: int, filters: Mapping[str, str] | None = None, method: str | None = None
    ) -> Found:
        """The k adapters most similar to the query: {space, method, embedder_ids, results, index_states}."""
        if not 1 <= k <= MAX_K:
            raise UsageError(f"k must be between 1 and {MAX_K}, got {k}")
        state = self.space(session, space)
        method = method or state.default_method
        if method not in SEARCH_METHODS:
            raise UsageError(f"unknown search method {method!r}; one of {', '.join(SEARCH_METHODS)}")
        with state.lock.read():
            allowed = self._allowed(session, state, filters) if filters else None
            embedders = [self._embedder(state, kind, method) for kind in METHOD_EMBEDDERS[method]]
            if method == "hybrid":
                search = self._hybrid_search(state)
                exact, kinds = (search.exact if search.w2t_weight < 1 else None), stage_kinds(search, state.embedders)
            elif method in EXACT_SCORES:
                exact, kinds = method, candidate_kinds(method, state.embedders)
            else:
                exact, kinds = None, METHOD_EMBEDDERS[method]
            embedders += [state.embedders[kind] for kind in kinds if kind not in METHOD_EMBEDDERS[method]]
            searched = [e for e in embedders if e.method in kinds]
            vectors = {e.method: self._query_vector(state, e, query) for e in searched}
            exact_stage = method == "hybrid" or method in EXACT_SCORES
            fetch = max(k, CANDIDATES) + 1  # re-ranked below by stored vectors (and the module store)
            pool: set[int] = set()
            for e in searched:
                pool.update(self._nearest(e.index, vectors[e.method], fetch, allowed))
            pool.discard(-1)
            if query.adapter_id is not None:
                pool.discard(query.adapter_id)
            candidates = np.array(sorted(pool), dtype=np.int64)
            scores, keys = self._scores(state, method, query, vectors, candidates)
            top = top_k(keys, k)
            hit_ids = candidates[top].tolist()
            info = [state.attributes.name_and_labels(i) for i in hit_ids]
        results: list[Hit] = [
            {"adapter_id": i, "name": name, "score": float(scores[j]), "labels": labels}
            for i, j, (name, labels) in zip(hit_ids, top.tolist(), info, strict=True)
        ]
        return {
            "space": state.name,
            "method": method,
            "embedder_ids": [e.id for e in embedders],
            "module_stage": self._module_stage(state, exact) if exact_stage else None,
            "index_states": {**{e.method: e.state for e in embedders}, **self._missing(state, exact)},
            "results": results,
        }

    def stored_vectors(self, session: Session, space: str, kind: str, ids: Sequence[int]) -> dict[int, np.ndarray]:
        """The unit vectors the space's `kind` index (sketch, raw, w2t) holds for those of `ids` it has, by id: read from
        memory, as a search reads them (an IVF index keeps float16 codes), never from the database. A space already
        loaded is read as it is, without catching up with the database first: the caller asks for ids a search just
        found, and reads any it does not get elsewhere."""
        with self._lock:
            loaded = self._spaces.get(space)
        state = loaded if loaded is not None else self.space(session, space)
        e = state.embedders.get(kind)
        if e is None or not len(ids):
            return {}
        with state.lock.read():
            held = np.array([i for i in ids if e.index.contains(int(i))], np.int64)
            vectors = e.index.vectors(held) if len(held) else np.zeros((0, e.index.dim), np.float32)
        return dict(zip(held.tolist(), vectors, strict=True))

    def stored_neighbours(self, session: Session, space: str, method: str, ids: Sequence[int], k: int) -> dict[int, list[Neighbour]]:
        """(id, score) of the k nearest of each of the stored adapters `ids` by a vector method (sketch, raw, w2t), best
        first: what `similar(..., method=method)` ranks for each alone, from one search of the index for all of them
        (the relation step asks for a batch of adapters at a time). An id the index does not hold is left out."""
        state = self.space(session, space)
        e = self._embedder(state, VECTOR_SCORES[method], method)
        with state.lock.read():
            held = np.array([i for i in dict.fromkeys(ids) if e.index.contains(int(i))], np.int64)
            if not len(held):
                return {}
            queries = e.index.vectors(held)
            found = e.index.search(queries, max(k, CANDIDATES) + 1)[1]
            out: dict[int, list[Neighbour]] = {}
            for i, q, row in zip(held.tolist(), queries, found, strict=True):
                candidates = np.array(sorted(set(row.tolist()) - {-1, i}), dtype=np.int64)
                scores = e.index.vectors(candidates) @ q if len(candidates) else np.zeros(0)
                top = top_k(scores, k)
                out[i] = list(zip(candidates[top].tolist(), scores[top].tolist(), strict=True))
        return out

    @staticmethod
    def _allowed(session: Session, state: SpaceState, filters: Mapping[str, str]) -> np.ndarray:
        """Ids the filters keep: labels from memory (`label.rank` the label rank), adapter columns (base_model, format, rank,
        source) in SQL."""
        columns = {k: v for k, v in filters.items() if k in repository.COLUMN_FILTERS}
        allowed = np.array(repository.filter_adapter_ids(session, state.base_model, columns), np.int64) if columns else None
        for key, value in filters.items():
            if key not in repository.COLUMN_FILTERS:
                ids = state.attributes.with_label(label_key(key), value)
                allowed = ids if allowed is None else np.intersect1d(allowed, ids, assume_unique=True)
        assert allowed is not None  # called with filters only, each of which narrowed it
        return np.sort(allowed)

    @staticmethod
    def _missing(state: SpaceState, exact: str | None) -> dict[str, str]:
        """The indexes that would give an exact score candidates that the space lacks, each with what stands in."""
        wanted = exact_sources(exact) if exact is not None else ()
        return {
            kind: f"not built: candidates from the {SKETCH} index instead; run `zoo embed --space {state.name}`"
            for kind in wanted
            if kind not in state.embedders
        }

    def _embedder(self, state: SpaceState, kind: str, method: str) -> LoadedEmbedder:
        e = state.embedders.get(kind)
        if e is None:
            todo = "zoo train" if kind == W2T else "zoo embed"
            raise NotReadyError(f"space {state.name} has no {kind} embeddings yet for --method {method}: run `{todo} --space {state.name}`")
        if method == "hybrid" and kind == W2T and e.objective == "contrastive":
            raise NotReadyError(f"--method hybrid needs a supervised W2T: run `zoo train --space {state.name}`")
        return e

    def _query_vector(self, state: SpaceState, e: LoadedEmbedder, query: Query) -> np.ndarray:
        """The query's unit vector under an embedder: the stored one, else computed from its factors."""
        if query.adapter_id is not None and e.index.contains(query.adapter_id):
            return e.index.vectors(np.array([query.adapter_id]))[0]
        if e.method == RAW:  # a file's gauge is read at ingest only
            raise UsageError(f"{query.name}: --method raw compares stored adapters only; ingest it first")
        schema = self.w2t(e).schema if e.method == W2T else SpaceSchema.from_dict(e.config["schema"])
        if not schema.fits(query.factors):
            raise UsageError(f"{query.name} does not fit space {state.name}: its modules or shapes differ from the space's")
        if e.method == SKETCH:
            return module_sketches([query.factors], schema.module_names, int(e.config["dim"]))[0]
        if e.method == GRAM:
            return gram_sketches([query.factors], schema.module_names, int(e.config["dim"]))[0]
        return self.w2t(e).embed([_as_zoo_adapter(query)])[0]

    def w2t(self, e: LoadedEmbedder) -> W2TEnsemble:
        return load_w2t(self.data_dir / str(e.checkpoint), self.device)

    @staticmethod
    def _nearest(index: AdapterIndex, vector: np.ndarray, fetch: int, allowed: np.ndarray | None) -> list[int]:
        if allowed is not None and not len(allowed):
            return []
        return index.search(vector[None, :], fetch, allowed=allowed)[1][0].tolist()

    @staticmethod
    def _module_stage(state: SpaceState, exact: str | None) -> str:
        """What an exact score is computed from: the module store, else the sketches that estimate it (`_exact`)."""
        if state.modules is not None:
            return "exact (module store)"
        return (
            "input-Gram sketches (no module store)"
            if exact == "input_gram" and GRAM in state.embedders
            else "module sketches (no module store)"
        )

    def _scores(
        self, state: SpaceState, method: str, query: Query, vectors: dict[str, np.ndarray], ids: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The method's scores between the query and the adapters `ids`, and the keys that order them (the scores
        themselves, but for a search score with a second stage: SearchScore.ranking)."""
        if not len(ids):
            return np.zeros(0), np.zeros(0)
        if method in VECTOR_SCORES:
            kind = VECTOR_SCORES[method]
            scores = state.embedders[kind].index.vectors(ids) @ vectors[kind]
            return scores, scores
        if method in EXACT_SCORES:
            scores = self._exact(state, query, vectors, ids, method)
            return scores, scores
        return self._search_scores(state, self._hybrid_search(state), query, vectors, ids)

    def _hybrid_search(self, state: SpaceState) -> SearchScore:
        """The search score `zoo train` chose for the space: hybrid's."""
        return served_search(self.data_dir / str(state.embedders[W2T].checkpoint))

    def _search_scores(
        self, state: SpaceState, score: SearchScore, query: Query, vectors: dict[str, np.ndarray], ids: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """A search score between the query and the adapters `ids`: its similarity, and the keys that order them."""
        weight = score.w2t_weight
        if weight <= 0:  # the exact score alone (a second stage needs a W2T-heavier first)
            exact_only = self._exact(state, query, vectors, ids, score.exact)
            return exact_only, exact_only
        exact = self._exact(state, query, vectors, ids, score.exact) if weight < 1 else 0.0
        w2t = state.embedders[W2T].index.vectors(ids) @ vectors[W2T]
        return score.similarity(exact, w2t), score.ranking(exact, w2t)

    def _exact(self, state: SpaceState, query: Query, vectors: dict[str, np.ndarray], ids: np.ndarray, score: str) -> np.ndarray:
        """An exact score (zoo.domain.channels.exact_cosines, or the channel metric `zoo train` fitted: its atoms in
        r×r blocks) from the module store; without one, estimated from the sketches: the input Gram from the input-Gram
        sketches where the space has them for every candidate, else (and for the other scores) the module sketches'
        cosine stands in. A channel metric has no estimate: without the module store it is refused."""
        store = state.modules
        if store is not None and all(int(i) in store.rows for i in ids.tolist()):
            if query.adapter_id is not None and query.adapter_id in store.rows:
                q = store.take([query.adapter_id])
            else:
                q = ModuleStack.of([query.factors], store.dense)
            gallery = store.take(ids.tolist())
            if fitted_purpose(score) is not None:
                return served_metric(self.data_dir / str(state.embedders[W2T].checkpoint), score).between(gallery, q)[0]
            return exact_cosines(gallery, q, score)[0]
        if fitted_purpose(score) is not None:
            raise NotReadyError(f"space {state.name} serves the channel metric {score}, which needs its module store: run `zoo embed`")
        kind = GRAM if score == "input_gram" and GRAM in vectors else SKETCH
        e = state.embedders[kind]
        if kind == GRAM and not all(e.index.contains(int(i)) for i in ids.tolist()):  # embedded before `zoo embed` caught up
            e, kind = state.embedders[SKETCH], SKETCH
        if kind not in vectors:
            vectors[kind] = self._query_vector(state, e, query)
        n_modules = len(SpaceSchema.from_dict(e.config["schema"]).modules)
        return sketch_module_cosines(vectors[kind][None, :], e.index.vectors(ids), n_modules)[0]

    def predict(self, session: Session, space: str, query: Query) -> Predicted:
        """Attributes (top-3 classes with probabilities) and metrics (value, 90 % interval, predictor), each by
        the predictor `zoo train` chose out of fold: the W2T heads or a readout of its embedding, a kNN in its
        embedding, or a similarity-weighted kNN among the labelled adapters it trained with ("knn", by an exact
        or search score and k)."""
        state = self.space(session, space)
        e = state.embedders.get(W2T)
        if e is None or e.objective == "contrastive":
            raise NotReadyError(f"space {state.name} has no supervised W2T embedder: run `zoo train --space {state.name}`")
        model = self.w2t(e)
        if not model.schema.fits(query.factors):
            raise UsageError(f"{query.name} does not fit space {state.name}")
        probs, values = model.predict([_as_zoo_adapter(query)])
        knns = {k: chosen for k in (*probs, *values) if isinstance(chosen := model.predictor(k), KnnPredictor)}
        similarities = {knn.similarity for knn in knns.values()}
        if probs:
            similarities.add(model.search)  # the labelled neighbours that support (or not) each attribute's prediction
        near = {s: self._labelled_neighbours(session, state, model, query, s) for s in sorted(similarities, key=lambda s: s.name)}
        attributes: dict[str, list[ClassGuess]] = {}
        confidence: dict[str, Confidence] = {}
        at_memory = np.flatnonzero(model.memory_ids == query.adapter_id) if query.adapter_id is not None else np.zeros(0, np.int64)
        for key, p in probs.items():
            classes = model.config.categorical[key]
            labels = model.memory_classes(key)
            knn = knns.get(key)
            k = knn.k if knn else SUPPORT_K
            around = near[knn.similarity if knn else model.search]
            shares = knn_shares(around, labels, len(classes), p[0], k) if knn else p[0]
            # a labelled adapter's vote leaves its own label out (it is not its own neighbour): one label fewer
            own = bool(len(at_memory)) and labels[at_memory[0]] >= 0
            shares = model.calibrated(key, shares, own_label_left_out=knn is not None and own)
            support = neighbour_classes(around, labels, len(classes), k)
            order = top_k(shares, 3)
            attributes[key] = [{"value": classes[i], "probability": float(shares[i]), "neighbours": int(support[i])} for i in order]
            top, n = int(order[0]), int(support.sum())
            confidence[key] = {
                "sure": is_sure(float(shares[top]), int(support[top]), n, model.sure_from(key)),
                "neighbours": n,
                "agreeing": int(support[top]),
                "calibrated": key in model.calibration,
                "given": None,
                "agrees": None,
            }
        metrics: dict[str, MetricGuess] = {}
        for key, v in values.items():
            value = float(v[0])
            if (knn := knns.get(key)) is not None:
                found = knn_value(near[knn.similarity], model.memory_values[key], value, knn.k)
                value = float(model.clip(key, np.array([found]))[0])
            low, high = _interval(value, model.residual_std.get(key), *model.metric_range.get(key, (-math.inf, math.inf)))
            metrics[key] = {
                "value": value,
                "low": low,
                "high": high,
                "interval": 0.9 if low is not None else None,
                "predictor": model.predictor(key).kind,
                "method": model.predictor(key).name,
                "measured": None,
                "within": None,
            }
        return {
            "space": state.name,
            "embedder_id": e.id,
            "attributes": attributes,
            "confidence": confidence,
            "metrics": metrics,
            "predictors": {k: model.predictor(k).name for k in (*probs, *values)},
            "search": model.search.name,
            "choices": model.choices,
        }

    def _labelled_neighbours(
        self, session: Session, state: SpaceState, model: W2TEnsemble, query: Query, similarity: SearchScore
    ) -> tuple[np.ndarray, np.ndarray]:
        """The labelled training adapters nearest the query by a search score (`similarity`): (their positions in the
        model's memory, scores), from both indexes' CANDIDATES nearest among them, re-scored exactly. The scores
        are the keys that order them: the similarity itself, the vote's weights, but for a search with a second stage
        (whose keys only order: the support of an attribute's prediction)."""
        memory_ids = model.memory_ids
        allowed = np.sort(memory_ids)
        with state.lock.read():
            kinds = stage_kinds(similarity, state.embedders)
            embedders = [self._embedder(state, kind, "hybrid") for kind in METHOD_EMBEDDERS["hybrid"]]
            searched = [
                *(e for e in embedders if e.method in kinds),
                *(state.embedders[k] for k in kinds if k not in METHOD_EMBEDDERS["hybrid"]),
            ]
            vectors = {e.method: self._query_vector(state, e, query) for e in searched}
            pool: set[int] = set()
            for e in searched:
                pool.update(self._nearest(e.index, vectors[e.method], CANDIDATES, allowed))
            pool.discard(-1)
            if query.adapter_id is not None:
                pool.discard(query.adapter_id)
            candidates = np.array(sorted(pool), dtype=np.int64)
            keys = self._search_scores(state, similarity, query, vectors, candidates)[1] if len(candidates) else np.zeros(0)
        at = {int(i): j for j, i in enumerate(memory_ids.tolist())}
        return np.array([at[int(i)] for i in candidates.tolist()], np.int64), keys


@functools.lru_cache(maxsize=64)
def served_search(checkpoint: Path) -> SearchScore:
    """The search score a W2T checkpoint serves as hybrid (its directory is never rewritten, so this is cached)."""
    return search_of(checkpoint_meta(checkpoint))


def stage_kinds(search: SearchScore, have: Mapping[str, object]) -> tuple[str, ...]:
    """The embedders whose indexes give a search score its candidates: those it weighs (its exact score's
    `candidate_kinds`, W2T for its cosine, both for a mix), of those the space has."""
    weight = search.w2t_weight
    exact = candidate_kinds(search.exact, have) if weight < 1 else ()
    return (*exact, W2T) if weight > 0 else exact


def candidate_kinds(score: str, have: Mapping[str, object]) -> tuple[str, ...]:
    """The embedders whose indexes give an exact score its first-stage candidates: exact_sources(score) of those
    the space has (`have`: by method), the module sketch where it has none of them."""
    return tuple(k for k in exact_sources(score) if k in have) or (SKETCH,)


def exact_sources(score: str) -> tuple[str, ...]:
    """The indexes whose nearest are an exact score's first-stage candidates: EXACT_CANDIDATES', or a channel
    metric's FITTED_CANDIDATES."""
    return FITTED_CANDIDATES if fitted_purpose(score) is not None else EXACT_CANDIDATES[score]


@functools.lru_cache(maxsize=64)
def served_metric(checkpoint: Path, name: str) -> ChannelMetric:
    """A channel metric a W2T checkpoint serves, by its score's name (its directory is never rewritten, so this is
    cached)."""
    metrics = channel_metrics_of(checkpoint_meta(checkpoint))
    if name not in metrics:
        raise NotReadyError(f"the W2T checkpoint {checkpoint.name} has no channel metric {name}: run `zoo train` again")
    return metrics[name]


def _as_zoo_adapter(query: Query) -> ZooAdapter:
    return ZooAdapter(query.adapter_id or -1, query.name, query.factors)
