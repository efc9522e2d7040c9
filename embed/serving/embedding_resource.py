"""Embedding a space (`zoo embed`) and newly stored adapters (the workers' batches): every serving embedder's
vectors, written a chunk at a time under the space's lock, and the space's files (index files, module store, map)
brought up to the database. Each returns a plain dict, one per resource, that `--json` prints."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import numpy as np

from embed.data.dataset import load_adapters
from embed.data.types import SpaceSchema, ZooAdapter, schema_from_shapes
from embed.serving.budgets import embed_chunk_bytes
from embed.serving.gram_sketch import gram_sketch_width, gram_sketches
from embed.serving.index_files import update_index_file
from embed.serving.maps import refresh_map
from embed.serving.module_store import update_module_store
from embed.serving.search_methods import GRAM, RAW, SKETCH, W2T
from embed.serving.space_state import load_w2t
from zoo.domain.raw_sketch import raw_sketches, raw_width
from zoo.domain.similarity import module_sketches, sketch_width
from zoo.store import repository, space_adapters
from zoo.store.blobs import BlobStore
from zoo.store.embedders import active_embedder, find_embedder, get_embedder, register, serving_embedders
from zoo.store.embeddings import embedded_ids
from zoo.store.embeddings import store_embeddings as store_vectors
from zoo.store.locks import space_lock
from zoo.store.models import Embedder, EmbeddingSpace
from zoo.store.read_ahead import ReadAhead
from zoo.store.session import Session, Sessions, read_snapshot, write_transaction
from zoo.store.shared_files import local_folder
from zoo.store.spaces import ensure_space, find_space, get_space_by_id

#: how module-sketch blocks are scaled (zoo.domain.similarity.module_sketches); embedders of another scale are replaced
SKETCH_SCALE = "module-norm"
#: adapters embedded and committed per transaction
EMBED_CHUNK = 256

EmbedFn = Callable[[list[ZooAdapter]], np.ndarray]


class IndexFile(TypedDict):
    """An embedder's index file, brought up to the database."""

    method: str
    total: int
    index: str  # what it took (update_index_file)
    index_kind: str


class SpaceFiles(TypedDict):
    """A space's files, brought up to the database (refresh_space_files)."""

    indexes: dict[int, IndexFile]  # by embedder id
    module_store: str
    map: str


class EmbedReport(TypedDict):
    """`zoo embed`'s report of one serving embedder of a space."""

    space: str
    embedder_id: int
    method: str
    total: int
    index: str
    index_kind: str
    embedded: int
    skipped_not_fitting: int
    module_store: str
    map: str


def embed_function(embedder: Embedder, blobs: BlobStore, data_dir: Path, device: str | None = None) -> tuple[EmbedFn, SpaceSchema]:
    """How an embedder turns adapters into vectors, and the module vocabulary it was made for (a W2T checkpoint
    another node trained is fetched from the bucket first)."""
    if embedder.method == W2T:
        model = load_w2t(local_folder(blobs, data_dir, str(embedder.checkpoint)), device)
        return model.embed, model.schema
    schema = SpaceSchema.from_dict(embedder.config["schema"])
    dim = int(embedder.config["dim"])
    if embedder.method == RAW:
        return (lambda adapters: raw_sketches([a.factors for a in adapters], schema.modules, dim)), schema
    if embedder.method == GRAM:
        return (lambda adapters: gram_sketches([a.factors for a in adapters], schema.module_names, dim)), schema
    return (lambda adapters: module_sketches([a.factors for a in adapters], schema.module_names, dim)), schema


def ensure_sketch(session: Session, space: EmbeddingSpace, schema: SpaceSchema) -> Embedder:
    """The space's training-free module-sketch embedder (a new one if the module vocabulary grew, or if the current
    one was made with other probes per module or before blocks were scaled by the module's norm)."""
    current = active_embedder(session, space, method=SKETCH)
    dim = sketch_width(len(schema.modules))
    config = {"schema": schema.as_dict(), "dim": dim, "scale": SKETCH_SCALE}
    if current is not None and current.config == config:
        return current
    return register(session, space, SKETCH, len(schema.modules) * dim, retire=("dw_sketch",), config=config)


def ensure_raw(session: Session, space: EmbeddingSpace, schema: SpaceSchema) -> Embedder:
    """The space's raw-factor sketch embedder (a new one if the module vocabulary grew)."""
    current = active_embedder(session, space, method=RAW)
    dim = raw_width(len(schema.modules))
    config = {"schema": schema.as_dict(), "dim": dim}
    if current is not None and current.config == config:
        return current
    return register(session, space, RAW, len(schema.modules) * dim, config=config)


def ensure_gram(session: Session, space: EmbeddingSpace, schema: SpaceSchema) -> Embedder:
    """The space's input-Gram sketch embedder, input_gram search's first stage (a new one if the module vocabulary
    grew; a space embedded before it gets one at its next `zoo embed`)."""
    current = active_embedder(session, space, method=GRAM)
    dim = gram_sketch_width(len(schema.modules))
    config = {"schema": schema.as_dict(), "dim": dim, "channel": "input_gram"}
    if current is not None and current.config == config:
        return current
    return register(session, space, GRAM, len(schema.modules) * dim, config=config)


#: the order in which embed_space embeds and reports: the module sketches (which search and the relation step need) first
_REPORT_ORDER = {SKETCH: 0, RAW: 1, GRAM: 2, W2T: 3}


def embed_space(sessions: Sessions, blobs: BlobStore, data_dir: Path, base_model: str, device: str | None = None) -> list[EmbedReport]:
    """Embed every adapter of the space not yet embedded, under every serving embedder; update the index
    files, the module store and the map. One report per embedder.

    Memory does not grow with the zoo: the space's module vocabulary comes from the module table, and the
    adapters' factors are read from the blob store a chunk at a time (`chunk_size`), each chunk embedded by
    every embedder and forgotten. Safe to run from several processes at once: the space and its sketch
    embedder are set up under the space's write lock; vectors are computed outside any transaction and
    committed a chunk at a time, each under the lock and without the adapters another process embedded
    meanwhile. A run killed half-way keeps its committed chunks, and the next run embeds the rest."""
    with sessions() as session:
        ids = space_adapters.space_adapter_ids(session, base_model)
    if not ids:
        return []
    space_id, embedder_ids = training_free_embedders(sessions, base_model)
    counts = _embed_ids(sessions, blobs, data_dir, base_model, embedder_ids, ids, device, subset=False)
    files = refresh_space_files(sessions, blobs, data_dir, space_id)
    indexes, store, zoo_map = files["indexes"], files["module_store"], files["map"]
    return [
        {
            "space": base_model,
            "embedder_id": e,
            **indexes[e],
            "embedded": embedded,
            "skipped_not_fitting": misfits,
            "module_store": store,
            "map": zoo_map,
        }
        for e, (embedded, misfits) in counts.items()  # in embedder_ids' order
        if e in indexes
    ]


def training_free_embedders(sessions: Sessions, base_model: str) -> tuple[int, list[int]]:
    """The space of a base model with its training-free embedders (module sketch, raw factors, input Gram) made for the
    module vocabulary of its stored adapters, as `zoo embed` makes them, under the space's lock: the space's id and
    its serving embedders' ids, in the order `zoo embed` reports them."""
    with sessions() as session:
        schema = stored_schema(session, base_model)
    with write_transaction(sessions, space_lock(base_model)) as session:
        space = ensure_space(session, schema.base_model, schema.modules)
        ensure_sketch(session, space, schema)
        ensure_raw(session, space, schema)
        ensure_gram(session, space, schema)
        serving = sorted(serving_embedders(session, space.id).values(), key=lambda e: _REPORT_ORDER.get(e.method, len(_REPORT_ORDER)))
        return space.id, [e.id for e in serving]


def embed_adapters(
    sessions: Sessions,
    blobs: BlobStore,
    data_dir: Path,
    adapter_ids: list[int],
    device: str | None = None,
    progress: Callable[[int], object] | None = None,
    new_spaces: bool = False,
) -> dict[str, int]:
    """Embed newly stored adapters under the serving embedders of their spaces: the incremental path
    every ingest takes (zoo/runners/embed_stage.py). Query engines see them at their next query (the space's version
    moved); index files, module stores and maps catch up in `refresh_space_files`. With `new_spaces`, a space without
    embedders gets the training-free ones first, made for the vocabulary of everything it stores
    (`training_free_embedders`); else it waits for `zoo embed`. An adapter that does not fit an existing embedder's
    modules waits for `zoo embed`, which makes a wider one. `progress` hears how many adapters each chunk finished.
    Returns the count embedded per space."""
    with sessions() as session:
        rows = space_adapters.lora_base_models(session, adapter_ids)
    by_space: dict[str, list[int]] = {}
    for base_model, adapter_id in rows:
        by_space.setdefault(base_model, []).append(adapter_id)
    if progress is not None and len(adapter_ids) > len(rows):
        progress(len(adapter_ids) - len(rows))  # not LoRA-like (a full checkpoint's spectra): nothing to embed
    out: dict[str, int] = {}
    for base_model, ids in sorted(by_space.items()):
        with sessions() as session:
            space = find_space(session, base_model)
            embedder_ids = [e.id for e in serving_embedders(session, space.id).values()] if space else []
        if not embedder_ids and new_spaces:
            embedder_ids = training_free_embedders(sessions, base_model)[1]
        counts = _embed_ids(sessions, blobs, data_dir, base_model, embedder_ids, sorted(ids), device, subset=True, progress=progress)
        if counts:
            out[base_model] = max(embedded for embedded, _ in counts.values())
    return out


def unembedded_ids(session: Session, base_model: str) -> list[int]:
    """The space's stored LoRA-like adapters without a vector under its serving module sketch (one anti-join;
    none when the space has no sketch yet): what a worker killed between storing and embedding left behind."""
    space = find_space(session, base_model)
    sketch = serving_embedders(session, space.id).get(SKETCH) if space else None
    if sketch is None:
        return []
    return space_adapters.unembedded_ids(session, base_model, sketch.id)


def stored_schema(session: Session, base_model: str) -> SpaceSchema:
    """The module vocabulary of a base model's stored LoRA-like adapters, read from the module table (no blobs):
    the vocabulary `embed.data.types.schema_of` gives for their factors."""
    return schema_from_shapes(base_model, space_adapters.module_shapes(session, base_model))


def chunk_size(session: Session, base_model: str) -> int:
    """Adapters per embedding chunk: as many as hold `embed_chunk_bytes()` of canonical factors on average (from the
    module table), between 1 and EMBED_CHUNK."""
    elements, adapters = space_adapters.factor_elements(session, base_model)
    per_adapter = 4 * elements / max(adapters, 1)
    return max(1, min(EMBED_CHUNK, int(embed_chunk_bytes() // max(per_adapter, 1.0))))


@dataclass
class _Plan:
    """One embedder's part of an embedding run."""

    id: int
    fn: EmbedFn
    schema: SpaceSchema
    done: set[int]
    embedded: int = 0
    misfits: int = 0
    retired: bool = False


def _embed_ids(
    sessions: Sessions,
    blobs: BlobStore,
    data_dir: Path,
    base_model: str,
    embedder_ids: list[int],
    ids: list[int],
    device: str | None,
    subset: bool,
    progress: Callable[[int], object] | None = None,
) -> dict[int, tuple[int, int]]:
    """Vectors, under each embedder, of the adapters among `ids` it has none for (and that fit it): the adapters are
    read a chunk at a time and each chunk committed under the space's lock, skipping what another process embedded
    meanwhile. (embedded, not fitting) per embedder id. `subset`: the ids are a few of the space's (look up only theirs)."""
    plans: list[_Plan] = []
    with sessions() as session:
        for embedder_id in embedder_ids:
            embedder = get_embedder(session, embedder_id)
            fn, schema = embed_function(embedder, blobs, data_dir, device)
            plans.append(_Plan(embedder_id, fn, schema, embedded_ids(session, embedder, ids if subset else None)))
        per_chunk = chunk_size(session, base_model)
        todo = [i for i in ids if any(i not in p.done for p in plans)]
    if progress is not None and len(ids) > len(todo):
        progress(len(ids) - len(todo))  # embedded already
    chunks = [todo[start : start + per_chunk] for start in range(0, len(todo), per_chunk)]

    def files(session: Session, chunk: list[int]) -> list[Path]:
        return blobs.local_files([d for d in space_adapters.factor_digests(session, chunk).values() if d])

    with ReadAhead() as ahead:
        for n, chunk in enumerate(chunks):
            with sessions() as session:
                # each chunk's blobs are read from disk while the chunk before is embedded
                ahead.add((files(session, chunk) if n == 0 else []) + (files(session, chunks[n + 1]) if n + 1 < len(chunks) else []))
                adapters = load_adapters(session, blobs, base_model, chunk)
            for plan in plans:
                if not plan.retired:
                    _embed_chunk(sessions, base_model, plan, adapters)
            if progress is not None:
                progress(len(chunk))
    return {p.id: (p.embedded, p.misfits) for p in plans}


def _embed_chunk(sessions: Sessions, base_model: str, plan: _Plan, adapters: list[ZooAdapter]) -> None:
    mine = [a for a in adapters if a.id not in plan.done]
    fitting = [a for a in mine if plan.schema.fits(a.factors)]
    plan.misfits += len(mine) - len(fitting)
    if not fitting:
        return
    vectors = plan.fn(fitting)
    with write_transaction(sessions, space_lock(base_model)) as session:
        embedder = find_embedder(session, plan.id)
        if embedder is None or not embedder.active:  # replaced by a concurrent run: it embeds for its own
            plan.retired = True
            return
        meanwhile = embedded_ids(session, embedder, [a.id for a in fitting])
        # adapters deleted since they were read are skipped (a delete takes the same lock: none is deleted from here on)
        alive = repository.existing_adapter_ids(session, (a.id for a in fitting))
        fresh = [j for j, a in enumerate(fitting) if a.id not in meanwhile and a.id in alive]
        store_vectors(session, embedder, [fitting[j].id for j in fresh], vectors[fresh])
        plan.embedded += len(fresh)


def refresh_space_files(sessions: Sessions, blobs: BlobStore, data_dir: Path, space_id: int) -> SpaceFiles:
    """Bring the space's files up to the database: each serving embedder's index file (method, total,
    how, kind by embedder id), the module store and the map. All from one snapshot of the database (`read_snapshot`): an
    adapter deleted meanwhile is in every file or in none, and the next refresh drops it (its tombstone)."""
    indexes: dict[int, IndexFile] = {}
    with sessions() as session:
        read_snapshot(session)
        for embedder in serving_embedders(session, space_id).values():
            index, how = update_index_file(session, data_dir, embedder)
            indexes[embedder.id] = {"method": embedder.method, "total": index.size, "index": how, "index_kind": index.kind}
        store = update_module_store(session, blobs, data_dir, get_space_by_id(session, space_id))
        zoo_map = refresh_map(session, data_dir, space_id)
    return {"indexes": indexes, "module_store": store, "map": zoo_map}
