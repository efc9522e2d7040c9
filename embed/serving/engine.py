"""The query engine: similar-adapter search and prediction at O(k) per query, one engine per process.

Per embedding space it holds, loaded once:
- each active embedder's FAISS index (embed/serving/index.py), from its file under `DATA/index/`, with
  every vector reachable by id: re-ranking reads stored vectors and never re-embeds;
- the supervised W2T ensemble (for the query's own vector and for predictions);
- the module store: every adapter's canonical factors as one `ModuleStack` (`DATA/rerank/`),
  for the exact module-cosine stage. `zoo embed` writes it while it fits `module_store_budget()`;
  a space without one scores module cosine from the stored module sketches instead (and the input Gram from the
  input-Gram sketches, those near the k-th from their float32 rows in the database: embed/serving/exact_rows.py).

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

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import faiss
import numpy as np

from embed.data.types import SpaceSchema, ZooAdapter
from embed.selection.metrics import top_k
from embed.serving.attributes import AdapterAttributes
from embed.serving.budgets import spaces_budget
from embed.serving.exact_rows import ExactRows, margin_of, near_kth, read_exact
from embed.serving.first_stage import first_stage
from embed.serving.gram_sketch import gram_sketches
from embed.serving.index import CANDIDATES
from embed.serving.index_files import open_index
from embed.serving.module_store import ModuleStore, module_store_path, read_module_store, stack_of, stale_module_rows, update_module_store
from embed.serving.predictions import attribute_guesses, metric_guesses
from embed.serving.results import Found, Hit, Neighbour, Predicted, Query
from embed.serving.search_methods import (
    GRAM,
    METHOD_EMBEDDERS,
    RAW,
    SEARCH_METHODS,
    SKETCH,
    VECTOR_SCORES,
    W2T,
    candidate_kinds,
    served_search,
    stage_kinds,
    stored_exact,
)
from embed.serving.space_state import DEFERRED, LoadedEmbedder, SpaceState, allowed_ids, load_w2t, space_bytes
from zoo.domain.exact_scores import EXACT_SCORES
from zoo.domain.fusion import fused
from zoo.domain.methods import KnnPredictor, SearchScore, fitted_by_training, fused_metric
from zoo.domain.similarity import ModuleStack, module_sketches, sketch_module_cosines
from zoo.errors import NotReadyError, StorageError, UsageError
from zoo.limits import MAX_K
from zoo.store.embedders import get_embedder, serving_embedders
from zoo.store.embeddings import deleted_since, load_embeddings
from zoo.store.label_reads import last_label_id
from zoo.store.models import EmbeddingSpace
from zoo.store.session import Session, Sessions, read_snapshot
from zoo.store.shared_files import local_folder
from zoo.store.spaces import get_space, get_space_by_id, space_version

if TYPE_CHECKING:
    from embed.w2t.ensemble import W2TEnsemble
    from zoo.store.blobs import BlobStore

log = logging.getLogger(__name__)


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
        active = serving_embedders(session, row.id)
        for method, e in ((m, e) for m, e in active.items() if m not in DEFERRED):
            index, index_state = open_index(session, self.data_dir, e, version)
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
        deferred = {m: e.id for m, e in active.items() if m in DEFERRED}
        state = SpaceState(row.id, row.name, row.base_model, version, embedders, modules, attributes, deferred=deferred)
        if modules is not None and have is not None and SKETCH in embedders:
            self._extend_modules(session, state, have[3])
        return state

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
        if active != state.active:  # an embedder was trained or replaced
            fresh = self._load(session, get_space_by_id(session, state.id))
            state.embedders, state.modules, state.attributes = fresh.embedders, fresh.modules, fresh.attributes
            state.deferred = fresh.deferred
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

    def _open_deferred(self, state: SpaceState, kinds: Iterable[str]) -> None:
        """Open the indexes of `kinds` that the space deferred (DEFERRED) as the database has them now."""
        if not any(kind in state.deferred for kind in kinds):
            return
        with state.lock.write(), self._snapshot() as snap:
            for kind in [k for k in kinds if k in state.deferred]:
                e = get_embedder(snap, state.deferred[kind])
                index, how = open_index(snap, self.data_dir, e, space_version(snap, state.id))  # may refuse: still deferred
                state.embedders[kind] = LoadedEmbedder(e.id, e.method, e.objective, e.checkpoint, dict(e.config), index, how)
                del state.deferred[kind]
        self._marks.pop(state.name, None)  # its bytes are measured again
        self._account(state.name, state)

    def _extend_modules(self, session: Session, state: SpaceState, after_version: int) -> None:
        """Add the factors of adapters sketched after `after_version` to the module store."""
        if state.modules is None:
            return
        sketch = get_embedder(session, state.embedders[SKETCH].id)
        ids, _ = load_embeddings(session, sketch, after_version=after_version)
        new = [int(i) for i in ids.tolist() if int(i) not in state.modules.rows]
        if new:
            state.modules = state.modules.extended(new, stack_of(session, self.blobs, new, state.modules.dense))

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
        self._open_deferred(state, METHOD_EMBEDDERS[method])
        with state.lock.read():
            allowed = allowed_ids(session, state, filters) if filters else None
            embedders = [self._embedder(state, kind, method) for kind in METHOD_EMBEDDERS[method]]
            depth = k  # how deep the scores decide the order (a second stage re-orders the top of the first)
            if method == "hybrid":
                search = self._hybrid_search(state)
                exact, kinds = (search.exact if search.w2t_weight < 1 else None), stage_kinds(search, state.embedders)
                depth = max(k, search.rerank_top) if search.second_stage is not None else k
            elif method in EXACT_SCORES:
                exact, kinds = method, candidate_kinds(method, state.embedders)
            else:
                exact, kinds = None, METHOD_EMBEDDERS[method]
            embedders += [state.embedders[kind] for kind in kinds if kind not in METHOD_EMBEDDERS[method]]
            searched = [e for e in embedders if e.method in kinds]
            vectors = {e.method: self._query_vector(state, e, query) for e in searched}
            exact_stage = method == "hybrid" or method in EXACT_SCORES
            fetch = max(k, CANDIDATES) + 1  # re-ranked below by stored vectors (and the module store)
            candidates = first_stage(searched, vectors, fetch, allowed, query)
            reads = ExactRows()
            scores, keys = self._scores(state, method, query, vectors, candidates, reads)
            if reads.lossy and len(candidates):  # the scores near the k-th again, from the database's float32 vectors
                near = candidates[near_kth(scores, depth, margin_of(state.embedders, reads.lossy))]
                read = near if query.adapter_id is None else np.append(near, query.adapter_id)
                reads.rows = read_exact(session, state.embedders, reads.lossy, read)
                scores, keys = self._scores(state, method, query, vectors, candidates, reads)
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
            "module_stage": state.module_stage(exact) if exact_stage else None,
            "index_states": {**{e.method: e.state for e in embedders}, **state.missing(exact)},
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
        self._open_deferred(state, (kind,))
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
        self._open_deferred(state, (VECTOR_SCORES[method],))
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
        return load_w2t(local_folder(self.blobs, self.data_dir, str(e.checkpoint)), self.device)

    def _scores(
        self, state: SpaceState, method: str, query: Query, vectors: dict[str, np.ndarray], ids: np.ndarray, reads: ExactRows
    ) -> tuple[np.ndarray, np.ndarray]:
        """The method's scores between the query and the adapters `ids`, and the keys that order them (the scores
        themselves, but for a search score with a second stage: SearchScore.ranking). Stored vectors are `reads`'."""
        if not len(ids):
            return np.zeros(0), np.zeros(0)
        if method in VECTOR_SCORES:
            kind = VECTOR_SCORES[method]
            scores = reads.vectors(state.embedders[kind], ids) @ reads.query(kind, query.adapter_id, vectors[kind])
            return scores, scores
        if method in EXACT_SCORES:
            scores = self._exact(state, query, vectors, ids, method, reads)
            return scores, scores
        return self._search_scores(state, self._hybrid_search(state), query, vectors, ids, reads)

    def _hybrid_search(self, state: SpaceState) -> SearchScore:
        """The search score `zoo train` chose for the space: hybrid's."""
        return served_search(self._checkpoint(state))

    def _search_scores(
        self, state: SpaceState, score: SearchScore, query: Query, vectors: dict[str, np.ndarray], ids: np.ndarray, reads: ExactRows
    ) -> tuple[np.ndarray, np.ndarray]:
        """A search score between the query and the adapters `ids`: its similarity, and the keys that order them."""
        weight = score.w2t_weight
        second: np.ndarray | None
        if weight < 1 and score.rerank_exact is not None:  # the metric's fusion with dW (SearchScore): the metric scored once
            exact, second = self._with_fusion(state, query, vectors, ids, score.exact, reads)
        else:
            exact = self._exact(state, query, vectors, ids, score.exact, reads) if weight < 1 else np.zeros(len(ids))
            second = self._exact(state, query, vectors, ids, score.rerank_exact, reads) if score.rerank_exact is not None else None
        if weight <= 0 and second is None:  # the exact score alone (a second stage by the same score needs a W2T-heavier first)
            return exact, exact
        w2t = state.embedders[W2T].index.vectors(ids) @ vectors[W2T] if weight > 0 else np.zeros(len(ids))
        return score.similarity(exact, w2t), score.ranking(exact, w2t, rerank_exact=second)

    def _checkpoint(self, state: SpaceState) -> Path:
        """The local folder of the W2T checkpoint the space serves."""
        return local_folder(self.blobs, self.data_dir, str(state.embedders[W2T].checkpoint))

    def _exact(
        self, state: SpaceState, query: Query, vectors: dict[str, np.ndarray], ids: np.ndarray, score: str, reads: ExactRows
    ) -> np.ndarray:
        """An exact score (search_methods.stored_exact, or a channel metric's fusion with dW: zoo/domain/fusion.py)
        from the module store; without one, estimated from the sketches: the input Gram from the input-Gram sketches
        where the space has them for every candidate, else (and for the other training-free scores) the module
        sketches' cosine stands in (their rows `reads`'). A score `zoo train` fitted has no estimate: without the module
        store it is refused."""
        if (metric := fused_metric(score)) is not None:
            return self._with_fusion(state, query, vectors, ids, metric, reads)[1]
        store = state.modules
        if store is not None and all(int(i) in store.rows for i in ids.tolist()):
            if query.adapter_id is not None and query.adapter_id in store.rows:
                q = store.take([query.adapter_id])
            else:
                q = ModuleStack.of([query.factors], store.dense)
            return stored_exact(store.take(ids.tolist()), q, score, lambda: self._checkpoint(state))
        if fitted_by_training(score):
            raise NotReadyError(f"space {state.name} serves the exact score {score}, which needs its module store: run `zoo embed`")
        kind = GRAM if score == "input_gram" and GRAM in vectors else SKETCH
        e = state.embedders[kind]
        if kind == GRAM and not all(e.index.contains(int(i)) for i in ids.tolist()):  # embedded before `zoo embed` caught up
            e, kind = state.embedders[SKETCH], SKETCH
        if kind not in vectors:
            vectors[kind] = self._query_vector(state, e, query)
        n_modules = len(SpaceSchema.from_dict(e.config["schema"]).modules)
        own = reads.query(kind, query.adapter_id, vectors[kind])
        return sketch_module_cosines(own[None, :], reads.vectors(e, ids), n_modules)[0]

    def _with_fusion(
        self, state: SpaceState, query: Query, vectors: dict[str, np.ndarray], ids: np.ndarray, metric: str, reads: ExactRows
    ) -> tuple[np.ndarray, np.ndarray]:
        """A channel metric between the query and the adapters `ids`, and its fusion with dW: each score on the scale of
        its own among the labelled adapters, the query left out."""
        memory = self.w2t(state.embedders[W2T]).memory_ids
        both = np.concatenate([ids, memory[memory != query.adapter_id] if query.adapter_id is not None else memory])
        dw, fitted = (self._exact(state, query, vectors, both, s, reads) for s in ("dw", metric))
        return fitted[: len(ids)], fused(dw[: len(ids)], fitted[: len(ids)], dw[len(ids) :], fitted[len(ids) :])[0]

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
        attributes, confidence = attribute_guesses(model, probs, knns, near, query.adapter_id)
        metrics = metric_guesses(model, values, knns, near, query.factors)
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
            candidates = first_stage(searched, vectors, CANDIDATES, allowed, query)
            keys = self._search_scores(state, similarity, query, vectors, candidates, ExactRows())[1] if len(candidates) else np.zeros(0)
        at = {int(i): j for j, i in enumerate(memory_ids.tolist())}
        return np.array([at[int(i)] for i in candidates.tolist()], np.int64), keys


def _as_zoo_adapter(query: Query) -> ZooAdapter:
    return ZooAdapter(query.adapter_id or -1, query.name, query.factors)
