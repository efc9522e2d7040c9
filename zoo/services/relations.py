"""The relation step: relations found from the weights of newly embedded adapters, among each one's
nearest neighbours in the query engine, stored as edges (zoo/store/relations.py).

Why after embedding and not inside ingest's transaction: the neighbours must come from an index (never a scan of the
space), and the engine's FAISS index of module sketches (scale-invariant: a rescaled copy, a cast, a merge's
parents and a continuation are all near) holds an adapter only once it is embedded. At ingest the only indexed
candidates are the near-duplicate window of the adapter's norm, which misses a copy with alpha changed and a
merge's parents. So the step runs where adapters get their vectors: `zoo embed`, and the workers' batches right
after ingest (zoo/runners/worker.py). The raw A and B are gone by then; what the detectors need of them (the
precisions a cast must fit, the exact zeros of a pruned copy) was kept at ingest (adapter.factor_summary).

Per adapter it costs O(k): its nearest by the module and the raw-factor sketches (k = NEIGHBOURS + RAW_NEIGHBOURS,
and the sources of those stored as copies), the factors of those k from the blob store, and `find_relations` on
them; then, so that a merge is found whichever of it and its parents came first, the merge test again for up to
RECHECK close neighbours, each against its own nearest (which now hold the new adapter), and for the merges that
name the adapter if it is found a later copy of another. Adapters are scanned BATCH at a time: one engine search a
method for the batch (`QueryEngine.stored_neighbours`) and one for its rechecks, one read of which neighbours were
scanned before; each scan is still stored on its own, in order. The step reads each adapter's factors once while its
budget holds them.
Which adapters are still to scan is in the database (`relation_scan`), so a killed run resumes and a run again
finds nothing to do; a new detector version (zoo.domain.relations.DETECTOR) scans everything again, and a larger read
budget (ZOO_EMBED_CHUNK_BYTES) the adapters a smaller one left neighbours out of (`read_budget`). A scan that
fails is recorded with its error and reported, never raised: the adapter stays stored and is tried again next time.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import numpy as np
from threadpoolctl import threadpool_limits

from embed.serving.engine import QueryEngine
from embed.serving.results import Neighbour
from embed.serving.search_methods import RAW, SKETCH
from zoo.config import EMBED_CHUNK_BYTES
from zoo.domain.merges import later_copies
from zoo.domain.relations import DETECTOR, Update, find_merge, find_relations
from zoo.errors import NotReadyError
from zoo.services.factor_cache import FactorCache, detector_bytes
from zoo.services.relation_rows import edge_rows, merge_rows
from zoo.services.threads import one_torch_thread
from zoo.store.blobs import BlobStore
from zoo.store.embedders import find_embedder, serving_embedders
from zoo.store.embeddings import load_embeddings
from zoo.store.errors import ConstraintError
from zoo.store.locks import space_lock
from zoo.store.relations import COPIES, EdgeRow, copy_edges, merges_naming, pending_scans, scanned_before, write_scan
from zoo.store.session import Session, Sessions, write_transaction
from zoo.store.spaces import find_space, space_version

#: nearest neighbours (by module-sketch cosine) a new adapter is compared with
NEIGHBOURS = 8
#: neighbours fetched, of which the later copies of another (rescaled, cast: the same module-sketch vector, the sketch
#: being scale-invariant) are dropped before NEIGHBOURS are kept: else a root's copies crowd its merges' other parents
#: out (on the lineage recipe, merges found with all their parents 1 of 12 -> 4 of 12 with the merge pool's own dedupe)
FETCHED = 2 * NEIGHBOURS
#: the least module-sketch cosine of a neighbour compared at all: every relation needs its dW to point the query's way
#: (a copy ~1, a truncation sqrt of the energy kept, a continuation >= 0.5 by module, a merge's parent about its share),
#: while unrelated adapters lie near 0; the detectors' cost at real widths is in these comparisons
MIN_SCORE = 0.05
#: neighbours by the raw-factor sketches compared too (those not among the module-sketch ones): a factorwise merge's
#: minor parents and a continuation whose dW turned away are near in the factors as the files had them, far in dW
#: (zoo.domain.raw_sketch.raw_sketches)
RAW_NEIGHBOURS = 8
#: the least raw-factor cosine of such a neighbour (a minor parent's: 0.1-0.2; an unrelated adapter's: about
#: 1/sqrt(the sketch's dimensions), 0.03-0.06)
MIN_RAW_SCORE = 0.05
#: close neighbours tested again as merges that may have the new adapter among their parents
RECHECK = 4
#: the least sketch cosine of a neighbour tested again (a merge's parents are near it: two equal parents, ~0.7)
RECHECK_SCORE = 0.3
#: the adapters that neighbours are stored copies of (zoo.store.relations.COPIES), compared too: a merge of an adapter
#: is as near a later cast of it (the lineage recipe's 3-parent merges had a minor parent's cast among their
#: neighbours and not the parent, and named the cast)
COPY_SOURCES = 4
#: adapters scanned at a time: one engine search (per method) for all of them, one read of which were scanned before
BATCH = 32
#: ONE_BLAS_THREAD: the detectors' products are of a few MB each (k·r columns of factors thousands of rows long), and on
#: a busy machine (load 5 on 2 cores) two BLAS threads took 69 s for one adapter's find_relations at Llama-3-8B's widths
#: where one took 0.9 s (threads waiting for descheduled threads); the step runs on one, numpy's and torch's (process-wide)
#: the step's first-generation threshold for Python's cyclic garbage collector (the default is 700): the detectors keep
#: each pair of updates' blocks per module (zoo.domain.lowrank.blocks), tens of thousands of small tuples, weak
#: references and callbacks an SDXL neighbourhood (418 modules a pair), which every collection traverses: a fifth of
#: the step's CPU at SDXL's widths (412 -> 341 ms an adapter at 50,000). The step makes next to no cyclic garbage.
GC_THRESHOLD = 50_000
#: errors kept in a report (the rest are counted)
REPORTED_ERRORS = 10
Progress = Callable[[int, int], object] | None


class RelationReport(TypedDict):
    """What one relation step did in one space."""

    space: str
    scanned: int
    edges: int
    failed: int
    errors: list[str]  # the first REPORTED_ERRORS: "adapter ID: reason"
    not_ready: str | None  # why the step stopped early (the engine had no index yet); the rest waits for the next run
    ms_per_adapter: float | None
    #: adapters compared with fewer neighbours than the step compares (COMPARED), since they and those neighbours in
    #: float64 would pass the read budget (ZOO_EMBED_CHUNK_BYTES, `neighbour_count`); `uncompared` of them with none
    budget_cut: int
    uncompared: int
    largest_mb: float | None  # the largest of those adapters in float64 (`detector_bytes`), MB


def relation_engine(sessions: Sessions, blobs: BlobStore, data_dir: Path, device: str | None = None) -> QueryEngine:
    """The engine the step searches: spaces' indexes alone (the step reads neighbours by their vectors and their factors
    from the blob store, never a module store, which takes up to ZOO_MODULE_STORE_BYTES a space)."""
    return QueryEngine(sessions, blobs, data_dir, device, module_stores=False)


def scan_space(
    engine: QueryEngine, sessions: Sessions, blobs: BlobStore, base_model: str, ids: Iterable[int] | None = None, progress: Progress = None
) -> RelationReport:
    """Scan the space's adapters not scanned by this detector yet (only among `ids` when given) and store their edges,
    BATCH adapters at a time; `progress` hears (adapters done, adapters to do) after each batch."""
    report = RelationReport(
        space=base_model,
        scanned=0,
        edges=0,
        failed=0,
        errors=[],
        not_ready=None,
        ms_per_adapter=None,
        budget_cut=0,
        uncompared=0,
        largest_mb=None,
    )
    with sessions() as session:
        space = find_space(session, base_model)
        serving = serving_embedders(session, space.id) if space else {}
        sketch = serving.get(SKETCH)
        if space is None or sketch is None:
            return report
        budget = EMBED_CHUNK_BYTES.get()
        todo, space_id, sketch_id, raw = pending_scans(session, sketch.id, DETECTOR, budget, ids), space.id, sketch.id, RAW in serving
    start = time.perf_counter()
    factors = FactorCache(sessions, blobs, budget)  # the step's: consecutive batches share neighbours
    with threadpool_limits(limits=1, user_api="blas"), one_torch_thread(), rare_collections():  # see ONE_BLAS_THREAD
        for first in range(0, len(todo), BATCH):
            scan = RelationScan(engine, sessions, base_model, sketch_id, raw, factors)
            if not _scan_batch(scan, space_id, todo[first : first + BATCH], report):
                break
            if progress is not None:
                progress(min(first + BATCH, len(todo)), len(todo))
    if report["scanned"]:
        report["ms_per_adapter"] = 1000 * (time.perf_counter() - start) / report["scanned"]
    return report


@contextmanager
def rare_collections() -> Iterator[None]:
    """Python's cyclic collections rarer while the step runs (GC_THRESHOLD), as they were after."""
    before = gc.get_threshold()
    gc.set_threshold(max(GC_THRESHOLD, before[0]), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def _scan_batch(scan: RelationScan, space_id: int, batch: list[int], report: RelationReport) -> bool:
    """Scan a batch and store each adapter's edges in a transaction of its own, in order (a later scan reads the
    copies and merges an earlier one stored); False if the engine was not ready (the rest waits for the next run)."""
    with scan.sessions() as session:
        version = space_version(session, space_id)  # the engine searches this version or a later one
    try:
        blind: dict[int, list[int]] | None = scan.prefetch(batch)
        failed = None
    except NotReadyError as exc:
        report["not_ready"] = str(exc)
        return False
    except Exception as exc:  # noqa: BLE001 - recorded for each adapter of the batch, tried again next time
        blind, failed = None, _error(exc)
    for adapter_id in batch:
        allowed: tuple[int, int] | None = None  # (neighbours compared at most, the adapter's bytes in float64)
        edges: list[EdgeRow] = []
        try:
            if blind is None:
                error = failed
            else:
                (edges, allowed), error = _scan(scan, adapter_id, blind.get(adapter_id, [])), None
        except NotReadyError as exc:
            report["not_ready"] = str(exc)
            return False
        except Exception as exc:  # noqa: BLE001 - one adapter's failure stops neither the step nor its ingest
            edges, error = [], _error(exc)
        cut = allowed is not None and allowed[0] < COMPARED
        if not store_edges(scan.sessions, scan.base_model, adapter_id, edges, version, error, scan.factors.budget if cut else None):
            continue  # deleted meanwhile
        scan.stored(adapter_id, edges)
        report["scanned"] += 1
        report["edges"] += len(edges)
        if allowed is not None and cut:
            report["budget_cut"] += 1
            report["uncompared"] += allowed[0] == 0
            report["largest_mb"] = max(report["largest_mb"] or 0.0, allowed[1] / 1e6)
        if error is not None:
            report["failed"] += 1
            if len(report["errors"]) < REPORTED_ERRORS:
                report["errors"].append(f"adapter {adapter_id}: {error}")
    return True


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).strip()[:300]}"


def store_edges(
    sessions: Sessions,
    base_model: str,
    adapter_id: int,
    edges: list[EdgeRow],
    version: int,
    error: str | None,
    read_budget: int | None = None,
) -> bool:
    """One transaction per scan, under the space's lock (one writer of its edges at a time); `read_budget`: the budget
    that left some of its neighbours uncompared. False when an adapter of the scan was deleted meanwhile (its foreign
    key fails): nothing is stored."""
    try:
        with write_transaction(sessions, space_lock(base_model)) as session:
            write_scan(session, adapter_id, edges, DETECTOR, version, error, read_budget)
    except ConstraintError:
        return False
    return True


@dataclass(frozen=True)
class RelationScan:
    """What scanning one batch of a space needs: the engine's searches for the batch (made at once, kept by method)
    and the neighbourhoods read from them."""

    engine: QueryEngine
    sessions: Sessions
    base_model: str
    sketch_id: int  # the space's module-sketch embedder
    raw: bool  # whether the space has raw-factor sketches
    factors: FactorCache  # the step's, shared by the neighbourhoods and the rechecks
    sketches: dict[int, np.ndarray] = field(default_factory=dict)  # module-sketch vectors read by this batch
    found: dict[str, dict[int, list[Neighbour]]] = field(default_factory=lambda: {"sketch": {}, "raw": {}})
    near_far: dict[tuple[int, bool], tuple[list[Neighbour], list[int]]] = field(default_factory=dict)
    #: the stored copy edges whose child is one of the ids asked for in this batch: child -> {parent: detector}, read
    #: once and kept as the batch's own scans store theirs (`stored`), as write_scan changes them
    copies: dict[int, dict[int, str]] = field(default_factory=dict)

    def prefetch(self, batch: list[int]) -> dict[int, list[int]]:
        """Search the engine for the whole batch at once (by the module sketches, by the raw factors), then for the
        close neighbours to test again as merges, and read the copy edges and the factors' whereabouts of all their
        neighbours. Returns the close neighbours to test, by adapter: those (at most RECHECK, outside the batch: an
        adapter of the batch has the others among its own neighbours) scanned before it was embedded."""
        self._search(batch, with_raw=True)
        members = set(batch)
        close = {a: [i for i, score in self._near_and_far(a, True)[0][:RECHECK] if score >= RECHECK_SCORE] for a in batch}
        close = {a: [i for i in ids if i not in members] for a, ids in close.items()}
        with self.sessions() as session:
            blind = scanned_before(session, close, self.sketch_id)
        rechecked = [i for ids in blind.values() for i in ids]
        self._search(rechecked, with_raw=False)
        around = [self._near_and_far(a, True) for a in batch] + [self._near_and_far(i, False) for i in rechecked]
        neighbours = [i for near, far in around for i in [*(n for n, _ in near), *far]]
        self.read_copies(neighbours)
        self.factors.expect([*batch, *rechecked, *neighbours])
        return blind

    def read_copies(self, ids: list[int]) -> None:
        """Read the stored copy edges of those of `ids` not read yet (one query)."""
        if todo := [i for i in dict.fromkeys(ids) if i not in self.copies]:
            with self.sessions() as session:
                edges = copy_edges(session, todo)
            for i in todo:
                self.copies[i] = {}
            for child, parent, detector in edges:
                self.copies[child][parent] = detector

    def stored(self, adapter_id: int, edges: list[EdgeRow]) -> None:
        """Keep the copy edges read as `write_scan` just changed them: the other detectors' edges around the adapter
        deleted, the scan's copy edges written."""
        for child, parents in self.copies.items():
            for parent in [p for p, d in parents.items() if d != DETECTOR and adapter_id in (child, p)]:
                del parents[parent]
        for e in edges:
            if e["relation"] in COPIES and e["child_id"] in self.copies:
                self.copies[e["child_id"]][e["parent_id"]] = DETECTOR

    def _search(self, ids: list[int], with_raw: bool) -> None:
        """The FETCHED nearest of those of `ids` not searched yet (one engine search a method)."""
        methods = ["sketch", "raw"] if self.raw and with_raw else ["sketch"]
        todo = {m: [i for i in dict.fromkeys(ids) if i not in self.found[m]] for m in methods}
        if not any(todo.values()):
            return  # the batch's searches hold them: every neighbourhood after prefetch
        with self.sessions() as session:
            for method, wanted in todo.items():
                found = self.engine.stored_neighbours(session, self.base_model, method, wanted, FETCHED) if wanted else {}
                self.found[method].update({i: found.get(i, []) for i in wanted})

    def _near_and_far(self, adapter_id: int, with_raw: bool) -> tuple[list[Neighbour], list[int]]:
        """The adapter's NEIGHBOURS nearest by module-sketch cosine (at least MIN_SCORE), and up to RAW_NEIGHBOURS others
        by the raw-factor sketches (at least MIN_RAW_SCORE; when the space has them and `with_raw`), but for the later
        copies of another among them."""
        key = (adapter_id, with_raw)
        if key not in self.near_far:
            self._search([adapter_id], with_raw)
            near = [h for h in self.found["sketch"][adapter_id] if h[1] >= MIN_SCORE]
            raw = [i for i, score in self.found["raw"][adapter_id] if score >= MIN_RAW_SCORE] if self.raw and with_raw else []
            with self.sessions() as session:
                copies = self.later_copies_of(session, [i for i, _ in near] + raw)
            near = [h for h in near if h[0] not in copies][:NEIGHBOURS]
            close = {i for i, _ in near}
            far = [i for i in raw if i not in copies and i not in close][:RAW_NEIGHBOURS]
            self.near_far[key] = near, far
        return self.near_far[key]

    def neighbours(self, adapter_id: int, with_raw: bool = True) -> list[tuple[int, float | None]]:
        """(id, module-sketch cosine) of the adapter's near neighbours (`_near_and_far`), then (id, None) of up to
        COPY_SOURCES adapters that those are stored copies of (as the batch's earlier scans left the copy edges; of a
        neighbour copied from several, the first stored; the nearest neighbours' first), then of its far ones by the
        raw-factor sketches."""
        near, far = self._near_and_far(adapter_id, with_raw)
        ids = [*(i for i, _ in near), *far]
        self.read_copies(ids)
        seen = {adapter_id, *ids}
        sources = [i for i in dict.fromkeys(min(self.copies[c]) for c in ids if self.copies[c]) if i not in seen]
        return [*near, *((i, None) for i in sources[:COPY_SOURCES]), *((i, None) for i in far)]

    def later_copies_of(self, session: Session, ids: list[int]) -> set[int]:
        """Those of the adapters that are later copies of another of them (parallel module sketches). Their sketches
        come from the engine's index, which holds every neighbour it found; the database only for one it no longer
        holds (deleted since) or not yet (embedded by another process)."""
        wanted = sorted(set(ids))
        if len(wanted) < 2:
            return set()
        if missing := [i for i in wanted if i not in self.sketches]:
            self.sketches.update(
                (i, v.astype(np.float64)) for i, v in self.engine.stored_vectors(session, self.base_model, SKETCH, missing).items()
            )
            unheld = np.array([i for i in missing if i not in self.sketches], dtype=np.int64)
            embedder = find_embedder(session, self.sketch_id) if len(unheld) else None
            if embedder is not None:
                found, vectors = load_embeddings(session, embedder, ids=unheld)
                self.sketches.update(zip(found.tolist(), vectors.astype(np.float64), strict=True))
        have = [i for i in wanted if i in self.sketches]
        if len(have) < 2:
            return set()
        vectors = np.stack([self.sketches[i] for i in have])
        return {have[k] for k in later_copies(vectors @ vectors.T, have)}


#: neighbours the step compares an adapter with, where the read budget holds them
COMPARED = NEIGHBOURS + COPY_SOURCES + RAW_NEIGHBOURS


def neighbour_count(size: int) -> int:
    """Neighbours compared with one adapter of `size` bytes in float64 (`detector_bytes`): COMPARED, fewer where it and they
    (each about the query's size: one space, one structure), in the detectors' float64, would pass the embedding's read
    budget (ZOO_EMBED_CHUNK_BYTES), none where the query alone does. So the step's memory is bounded by that budget,
    not by the zoo. A query larger than ZOO_RELATION_SAMPLE_BYTES is compared on a sample of its modules of that size
    (`FactorCache.query`), so at the defaults every query is compared with COMPARED neighbours, whatever its size."""
    return max(0, min(COMPARED, EMBED_CHUNK_BYTES.get() // max(1, size) - 1))


def _scan(scan: RelationScan, adapter_id: int, blind: list[int]) -> tuple[list[EdgeRow], tuple[int, int] | None]:
    """The edges of one adapter: its relations to its nearest neighbours, and the merges among its close neighbours
    that have it as a parent (of those `blind`: scanned before it was embedded; the others had it among their
    neighbours); with how many neighbours the read budget let it be compared with and its bytes in float64 (None if it
    is gone)."""
    found = _around(scan, adapter_id)
    if found is None:
        return [], None
    edges, near, k, size = found
    partners = {e["parent_id"] for e in edges} | {e["child_id"] for e in edges}
    close = [i for i, score in near[:RECHECK] if score is not None and score >= RECHECK_SCORE and i not in partners]
    for other in [i for i in close if i in blind]:
        edges += merge_naming(scan, other, adapter_id, k)
    for source in [e["parent_id"] for e in edges if e["relation"] in COPIES and e["child_id"] == adapter_id]:
        edges += _merges_renamed(scan, adapter_id, source, k)
    return edges, (k, size)


def _around(scan: RelationScan, adapter_id: int) -> tuple[list[EdgeRow], list[tuple[int, float | None]], int, int] | None:
    """(the adapter's edges to its neighbours, the neighbours, how many it may be compared with, its bytes in float64);
    None if it is gone."""
    query = scan.factors.query(adapter_id)
    if query is None:
        return None
    size = detector_bytes(query)
    k = neighbour_count(size)
    near = scan.neighbours(adapter_id)[:k] if k else []
    found = find_relations(query, scan.factors.get([i for i, _ in near], scan.factors.samples[adapter_id]))
    return sampled_evidence(edge_rows(found, adapter_id), query), near, k, size


def sampled_evidence(rows: list[EdgeRow], query: Update) -> list[EdgeRow]:
    """The rows with, where the query was compared on a sample of its modules, how many were compared of how many."""
    if query.whole_modules is not None:
        for row in rows:
            row["evidence"] = {**row["evidence"], "modules_compared": float(len(query.factors)), "modules": float(query.whole_modules)}
    return rows


def merge_naming(scan: RelationScan, other: int, adapter_id: int, k: int) -> list[EdgeRow]:
    """The merge rows of `other` if, among its k nearest, it is found to be a merge with `adapter_id` as a parent. Its
    module-sketch neighbours only: the raw-factor ones cost a query and their factors each, for every close neighbour
    of every new adapter (at a million synthetic adapters, 3.3 rechecks an adapter took 4 of its 5 raw queries)."""
    around = [i for i, _ in scan.neighbours(other, with_raw=False)][:k]
    if adapter_id not in around:
        return []
    me = scan.factors.query(other)
    merge = find_merge(me, scan.factors.get(around, scan.factors.samples[other])) if me is not None else None
    return sampled_evidence(merge_rows(merge, other), me) if me is not None and merge is not None and adapter_id in merge.parents else []


def _merges_renamed(scan: RelationScan, copy: int, source: int, k: int) -> list[EdgeRow]:
    """The merges stored with `copy` (just found a later copy of `source`) among their parents, fitted again with
    `source` beside it: the rows of those that `source` explains as well (a merge names the first stored of parallel
    copies, and of a cast and its source the source fits exactly), found whichever of the merge and the copy came
    first."""
    with scan.sessions() as session:
        merges = merges_naming(session, copy)
    rows = []
    for child, parents in merges.items():
        me = scan.factors.query(child)
        if me is None or source in parents:
            continue
        tried = [source, *(p for p in parents if p != copy), copy][:k]
        merge = find_merge(me, scan.factors.get(tried, scan.factors.samples[child]))
        if merge is not None and source in merge.parents and len(merge.parents) == len(parents):
            rows += sampled_evidence(merge_rows(merge, child), me)
    return rows
