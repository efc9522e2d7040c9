"""What the `zoo` commands (and later the web app) do with embeddings: embed, train, search, predict, index.

Plain functions over a session, the blob store, the data dir and the query engine; each returns a
plain dict, one per resource, that `--json` prints and the REST API will serve as it is. No printing.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict, TypeVar

import numpy as np

from embed.budgets import embed_chunk_bytes
from embed.dataset import base_models, load_adapters
from embed.engine import QueryEngine
from embed.gram_sketch import gram_sketch_width, gram_sketches
from embed.index import brute_force, recall_at_k
from embed.index_files import BUILD_CHUNK_BYTES, update_index_file
from embed.maps import refresh_map
from embed.module_store import update_module_store
from embed.refs import AdapterRef, StoredId
from embed.results import Found, Predicted, Query
from embed.search_methods import GRAM, RAW, SKETCH, W2T
from embed.space_state import load_w2t
from embed.types import SpaceSchema, ZooAdapter, schema_from_shapes
from zoo.config import Settings
from zoo.domain.base_models import guess_base_model
from zoo.domain.factorwise import raw_sketches, raw_width
from zoo.domain.similarity import module_sketches, sketch_width
from zoo.errors import NotFoundError, NotReadyError, SpaceNotFoundError, UsageError
from zoo.store import repository, space_adapters
from zoo.store.blob_backends import open_blob_store
from zoo.store.blobs import BlobStore
from zoo.store.embedders import active_embedder, find_embedder, get_embedder, register, serving_embedders
from zoo.store.embeddings import embedded_ids, embedding_ids, iter_embeddings, load_embeddings
from zoo.store.embeddings import store_embeddings as store_vectors
from zoo.store.imputation import FromLineage, from_lineage
from zoo.store.labels import given_labels
from zoo.store.locks import space_lock
from zoo.store.models import Embedder, EmbeddingSpace
from zoo.store.session import Session, Sessions, session_factory, write_transaction
from zoo.store.shared_files import local_folder, publish
from zoo.store.spaces import (
    all_spaces,
    ensure_space,
    find_space,
    get_space,
    get_space_by_id,
    space_base_model,
)

if TYPE_CHECKING:
    from embed.train import TrainOptions
    from zoo.formats import AdapterData

#: how module-sketch blocks are scaled (zoo.domain.similarity.module_sketches); embedders of another scale are replaced
SKETCH_SCALE = "module-norm"
#: adapters embedded and committed per transaction
EMBED_CHUNK = 256

EmbedFn = Callable[[list[ZooAdapter]], np.ndarray]
T = TypeVar("T")


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


class TrainMetrics(TypedDict):
    """How a W2T training went (its embedder's stored metrics)."""

    best_val_loss: float | None
    epochs: list[int]  # per member
    train_seconds: float
    n_adapters: int
    search: str
    choices: dict[str, dict[str, object]]


class TrainReport(TrainMetrics):
    """`zoo train`'s report."""

    space: str
    embedder_id: int
    objective: str | None
    checkpoint: str
    members: int
    heads: list[str]
    regression: list[str]
    predictors: dict[str, str]
    search: str
    embedded: NotRequired[dict[str, int]]  # adapters embedded by method, once `zoo train` has embedded them


class PreparedSpace(TypedDict):
    """`zoo quickstart`'s space: adapters embedded, and W2T's training report (or the kept W2T's, with "reused")."""

    embedded: int  # adapters in the space's index
    embedded_new: int  # of them, embedded by this call
    w2t: Mapping[str, Any] | None


class StoredAs(TypedDict):
    """The stored adapter a query file is (the same update, as ingest's duplicate check finds it)."""

    adapter_id: int
    name: str


class SearchResource(Found):
    """The search resource: the query, the stored adapter a query file is (`stored_as`; None for a stored adapter's
    id or a new file), then what the engine found."""

    query: str
    query_name: str
    stored_as: StoredAs | None


class PredictionResource(Predicted):
    """The prediction resource: the query, the stored adapter a query file is (`stored_as`), then what the engine
    predicted, and what a stored adapter inherits along the relations found from its weights (`from_lineage`; None
    for a new file, which has no edges)."""

    query: str
    query_name: str
    stored_as: StoredAs | None
    from_lineage: FromLineage | None


class FilteredSearch(TypedDict):
    """How an IVF index searches under a filter."""

    nprobe: int
    subset_rerank: int


#: a serving embedder's index as `zoo index` reports it; recall@10 against exact search unless rebuilt
IndexEntry = TypedDict(
    "IndexEntry",
    {
        "embedder_id": int,
        "method": str,
        "count": int,
        "dim": int,
        "kind": str,
        "codes": str | None,
        "nprobe": int | None,
        "rerank": int | None,  # IVF's
        "filtered": FilteredSearch | None,  # IVF's
        "state": str,
        "recall@10_vs_exact": NotRequired[float],
    },
)


class IndexReport(TypedDict):
    """`zoo index`'s report: each serving embedder's index, and the module store."""

    space: str
    embedders: list[IndexEntry]
    module_store: str


def slug(name: str) -> str:
    """The name as a file name's part: runs of other characters than letters, digits, `.`, `_` and `-` made `_`."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "space"


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
        schema = stored_schema(session, base_model)
        ids = space_adapters.space_adapter_ids(session, base_model)
    if not ids:
        return []
    with write_transaction(sessions, space_lock(base_model)) as session:
        space = ensure_space(session, schema.base_model, schema.modules)
        ensure_sketch(session, space, schema)
        ensure_raw(session, space, schema)
        ensure_gram(session, space, schema)
        serving = sorted(serving_embedders(session, space.id).values(), key=lambda e: _REPORT_ORDER.get(e.method, len(_REPORT_ORDER)))
        space_id, embedder_ids = space.id, [e.id for e in serving]
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


def embed_adapters(
    sessions: Sessions, blobs: BlobStore, data_dir: Path, adapter_ids: list[int], device: str | None = None
) -> dict[str, int]:
    """Embed newly stored adapters under the serving embedders of their spaces: the incremental path
    workers take after each batch. Query engines see them at their next query (the space's version
    moved); index files, module stores and maps catch up in `refresh_space_files`. Only spaces that
    have embedders already (a new space waits for `zoo embed`), only adapters that fit an embedder's
    modules (a wider vocabulary waits for `zoo embed` too). Returns the count embedded per space."""
    with sessions() as session:
        rows = space_adapters.lora_base_models(session, adapter_ids)
    by_space: dict[str, list[int]] = {}
    for base_model, adapter_id in rows:
        by_space.setdefault(base_model, []).append(adapter_id)
    out: dict[str, int] = {}
    for base_model, ids in sorted(by_space.items()):
        with sessions() as session:
            space = find_space(session, base_model)
            embedder_ids = [e.id for e in serving_embedders(session, space.id).values()] if space else []
        counts = _embed_ids(sessions, blobs, data_dir, base_model, embedder_ids, sorted(ids), device, subset=True)
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
    the vocabulary `embed.types.schema_of` gives for their factors."""
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
    for start in range(0, len(todo), per_chunk):
        with sessions() as session:
            adapters = load_adapters(session, blobs, base_model, todo[start : start + per_chunk])
        for plan in plans:
            if not plan.retired:
                _embed_chunk(sessions, base_model, plan, adapters)
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
    how, kind by embedder id), the module store and the map."""
    indexes: dict[int, IndexFile] = {}
    with sessions() as session:
        for embedder in serving_embedders(session, space_id).values():
            index, how = update_index_file(session, data_dir, embedder)
            indexes[embedder.id] = {"method": embedder.method, "total": index.size, "index": how, "index_kind": index.kind}
        store = update_module_store(session, blobs, data_dir, get_space_by_id(session, space_id))
        zoo_map = refresh_map(session, data_dir, space_id)
    return {"indexes": indexes, "module_store": store, "map": zoo_map}


def train_space(
    sessions: Sessions, blobs: BlobStore, data_dir: Path, base_model: str, options: TrainOptions, progress: bool = True
) -> TrainReport:
    """Train W2T on the adapters of the space that fit it (labels and measurements as given), save it
    under a name no other training uses, and register it. No transaction is open while it trains.

    The adapters are read a chunk at a time (as `zoo embed` reads them) and held only as W2T's tokens, projected to
    the options' token width as they are read, with the exact scores among the labelled from a module stack, or
    from module sketches where the space's module store would pass its budget (as the engine then serves them)."""
    from embed.budgets import module_store_budget
    from embed.dataset import read_training_set
    from embed.module_store import layout_bytes, module_layout
    from embed.tokens import torch_threads
    from embed.train import token_spec, train_w2t

    with sessions() as session:
        schema = stored_schema(session, base_model)
        ids = space_adapters.space_adapter_ids(session, base_model)
        if len(ids) < 10:
            raise NotReadyError(f"space {base_model} has {len(ids)} adapters: training needs at least 10")
        layout = module_layout(session, base_model, schema)
        per_chunk = chunk_size(session, base_model)
    t0 = time.perf_counter()
    rank = max((r for _, _, r in layout.values()), default=1) or 1
    dense = {n for n, (o, i, r) in layout.items() if r and o * i <= 2 * r * (o + i)}
    exact_from = (layout, dense) if len(ids) * layout_bytes(layout) <= module_store_budget() else None
    with torch_threads(options.threads):
        data = read_training_set(sessions, blobs, base_model, schema, ids, token_spec(options, schema, rank), rank, per_chunk, exact_from)
    if len(data.adapters) < 10:
        raise NotReadyError(f"space {base_model} has {len(data.adapters)} adapters: training needs at least 10")
    model = train_w2t(data.adapters, schema, options, progress=progress, tokens=data.tokens, exact=data.exact)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    checkpoint = Path("embedders") / f"{slug(base_model)}-w2t-{options.objective}-{stamp}-{uuid.uuid4().hex[:8]}"
    model.save(data_dir / checkpoint)
    publish(blobs, data_dir, checkpoint.as_posix())  # in the bucket before its row commits: every node can load it
    best = min(h["val_loss"] for h in model.history) if model.history else None
    metrics: TrainMetrics = {
        "best_val_loss": best,
        "epochs": [sum(1 for h in model.history if h["member"] == i) for i in range(len(model.models))],
        "train_seconds": round(time.perf_counter() - t0, 1),
        "n_adapters": len(data.adapters),
        "search": model.search.name,
        "choices": model.choices,
    }
    with write_transaction(sessions, space_lock(base_model)) as session:
        space = ensure_space(session, schema.base_model, schema.modules)
        embedder = register(
            session,
            space,
            W2T,
            model.dim,
            objective=options.objective,
            checkpoint=str(checkpoint),
            config={"options": {k: v for k, v in options.__dict__.items() if k != "device"}, "model": model.config.as_dict()},
            metrics=metrics,
        )
        embedder_id, objective = embedder.id, embedder.objective
    return {
        "space": base_model,
        "embedder_id": embedder_id,
        "objective": objective,
        "checkpoint": str(data_dir / checkpoint),
        **metrics,
        "members": len(model.models),
        "heads": sorted(model.config.categorical),
        "regression": model.config.regression,
        "predictors": {k: p.name for k, p in model.predictors.items()},
        "search": model.search.name,
    }


def resolve_space(session: Session, requested: str | None) -> EmbeddingSpace:
    """The embedding space asked for (one indexed read), or the zoo's only one: for queries, which need a space that exists."""
    if requested:
        return get_space(session, requested)
    spaces = all_spaces(session)
    if len(spaces) != 1:
        names = ", ".join(s.name for s in spaces) or "none yet: run `zoo embed`"
        raise UsageError(f"--space is needed: this zoo has {len(spaces)} embedding spaces ({names})")
    return spaces[0]


def resolve_base_model(session: Session, requested: str | None) -> str:
    """The space a command that embeds, trains or evaluates works on, by its base model: the one asked for, or the zoo's
    only base model with LoRA adapters (its space need not exist yet; resolve_space finds spaces that do)."""
    spaces = base_models(session)
    if requested:
        if requested not in spaces:
            raise SpaceNotFoundError(requested, spaces)
        return requested
    if len(spaces) != 1:
        raise UsageError(f"--space is needed: this zoo has {len(spaces)} embedding spaces ({', '.join(spaces) or 'none'})")
    return spaces[0]


def make_query(session: Session, blobs: BlobStore, ref: AdapterRef, device: str | None = None) -> tuple[Query, str | None]:
    """(query, its base model) for a stored id, or for a file read and canonicalized without storing it (whose base
    model, when the file names none, is the space its shapes name if the zoo has it)."""
    if isinstance(ref, StoredId):
        row = space_adapters.query_row(session, ref.id)
        if row is None:
            raise NotFoundError(f"no adapter with id {ref.id}: see `zoo list`")
        digest = row.factors_blob  # None for a checkpoint: it is found by its stored vectors, if it has any
        loader = (lambda: dict(blobs.get_factors(str(digest)))) if digest else None
        return Query(row.name, ref.id, loader), row.base_model
    from zoo.domain.canonical import canonicalize_modules, pick_device
    from zoo.formats import adapter_name, read_adapter

    data = read_adapter(Path(ref.path))
    if not data.modules:
        what = "a full checkpoint without --base" if data.format == "checkpoint" else f"a {data.format} file read as full-rank spectra"
        raise UsageError(f"{ref.text}: {what} has no low-rank update to search with")
    factors = canonicalize_modules(data.modules, pick_device(device))
    named = {m.name: f for m, f in zip(data.modules, factors, strict=True)}
    return Query(adapter_name(data.path), None, lambda: named), data.base_model or _guessed_space(session, data)


def _guessed_space(session: Session, data: AdapterData) -> str | None:
    """The space of the base model a file's shapes name (as ingest guesses it when nothing names one), if it exists."""
    guessed = guess_base_model((m.name, *m.shape) for m in data.modules).base_model
    return guessed if find_space(session, guessed) is not None else None


def search(
    engine: QueryEngine,
    session: Session,
    ref: AdapterRef,
    k: int,
    space: str | None = None,
    filters: Mapping[str, str] | None = None,
    method: str | None = None,
) -> SearchResource:
    """The search resource: the query, then the engine's answer."""
    query, base = make_query(session, engine.blobs, ref, engine.device)
    name = _space_name(session, space, query, base)
    query, stored_as = as_stored(session, engine.blobs, query, name)
    found = engine.similar(session, name, query, k, filters or {}, method)
    return {"query": ref.text, "query_name": query.name, "stored_as": stored_as, **found}


def predict(engine: QueryEngine, session: Session, ref: AdapterRef, space: str | None = None, lineage: bool = True) -> PredictionResource:
    """The prediction resource: predicted attributes and metrics of the query, and for a stored adapter what it inherits
    along its edges (not read when `lineage` is False: the caller has it already, or serves no attributes)."""
    query, base = make_query(session, engine.blobs, ref, engine.device)
    name = _space_name(session, space, query, base)
    query, stored_as = as_stored(session, engine.blobs, query, name)
    predicted = engine.predict(session, name, query)
    if query.adapter_id is not None:
        beside_given(predicted, *given_labels(session, query.adapter_id))
    inherited = from_lineage(session, query.adapter_id) if lineage and query.adapter_id is not None else None
    return {"query": ref.text, "query_name": query.name, "stored_as": stored_as, **predicted, "from_lineage": inherited}


def beside_given(predicted: Predicted, given: Mapping[str, str], measured: Mapping[str, float]) -> None:
    """Set each prediction beside what was given for the adapter: an attribute's given value and whether the top
    class is it, a metric's measured value and whether it lies in the predicted interval. A prediction for an
    adapter is made without its own labels (it is not its own neighbour), so it can disagree with them: the answer
    says so rather than showing the prediction alone."""
    for key, classes in predicted["attributes"].items():
        if key in given and key in predicted["confidence"]:
            confidence = predicted["confidence"][key]
            confidence["given"] = given[key]
            confidence["agrees"] = bool(classes) and classes[0]["value"] == given[key]
    for key, m in predicted["metrics"].items():
        if key in measured:
            value = measured[key]
            m["measured"] = value
            m["within"] = None if m["low"] is None or m["high"] is None else bool(m["low"] <= value <= m["high"])


def as_stored(session: Session, blobs: BlobStore, query: Query, space: str) -> tuple[Query, StoredAs | None]:
    """A query file that is a stored adapter of the space's base model (the same update, by ingest's duplicate check:
    zoo.store.duplicates) is answered as that adapter: from its stored factors, without itself among its neighbours,
    and with its given labels beside the predictions. So a file and the adapter stored from it get one answer, and
    the answer says which adapter that is. Anything else is answered as it is."""
    if query.adapter_id is not None:  # a search by id stays off torch (the fingerprint's probes)
        return query, None
    from zoo.domain.fingerprint import canonical_hash, sketch, structure_hash
    from zoo.store.duplicates import stored_duplicate

    base = space_base_model(session, space)
    if base is None:
        return query, None
    named = sorted(query.factors.items())
    sk = sketch(named)
    shapes = [(n, int(f.U.shape[0]), int(f.V.shape[0])) for n, f in named]
    match = stored_duplicate(session, blobs, base, canonical_hash(named, sk.fingerprint), structure_hash(shapes), sk, named)
    if match is None or match.factors_blob is None:
        return query, None
    digest = match.factors_blob
    name = space_adapters.adapter_name(session, match.id)
    return Query(query.name, match.id, lambda: dict(blobs.get_factors(digest))), {"adapter_id": match.id, "name": name}


def _space_name(session: Session, requested: str | None, query: Query, base: str | None) -> str:
    """The space to query: the one asked for (checked by the engine, which holds loaded spaces by name), else the
    query's base model's, else the zoo's only one. A stored adapter is never compared with another base model's
    adapters, even where its modules have their shapes (Mistral-7B's q/v are Llama-3-8B's)."""
    if requested and query.adapter_id is not None and base:
        space_base = space_base_model(session, requested)
        if space_base is not None and space_base != base:
            raise UsageError(
                f"adapter {query.adapter_id} is an adapter of {base!r}, not of space {requested!r}'s base model {space_base!r}: "
                f"search its own space (--space {base})"
            )
    return requested or base or resolve_space(session, None).name


def index_report(session: Session, blobs: BlobStore, data_dir: Path, space_name: str | None, rebuild: bool) -> IndexReport:
    """`zoo index rebuild|stats`: every active embedder's index (rebuilt if asked) and the module store."""
    space = resolve_space(session, space_name)
    embedders = list(serving_embedders(session, space.id).values())
    if not embedders:
        raise NotReadyError(f"space {space.name} has no embeddings yet: run `zoo embed`")
    out: list[IndexEntry] = []
    for e in embedders:
        index, how = update_index_file(session, data_dir, e, rebuild=rebuild)
        entry: IndexEntry = {
            "embedder_id": e.id,
            "method": e.method,
            "count": index.size,
            "dim": index.dim,
            "kind": index.kind,
            "codes": index.codes,
            "nprobe": index.nprobe,
            "rerank": index.rerank if index.ivf else None,
            "filtered": {"nprobe": index.filter_nprobe, "subset_rerank": index.filter_rerank} if index.ivf else None,
            "state": how,
        }
        if not rebuild and index.size:
            ids = embedding_ids(session, e)
            _, sample = load_embeddings(session, e, ids=np.random.default_rng(0).choice(ids, size=min(200, len(ids)), replace=False))
            entry["recall@10_vs_exact"] = recall_at_k(index.search(sample, 10)[1], exact_top_k(session, e, sample, 10))
        out.append(entry)
    return {"space": space.name, "embedders": out, "module_store": update_module_store(session, blobs, data_dir, space, rebuild=rebuild)}


def exact_top_k(session: Session, embedder: Embedder, queries: np.ndarray, k: int) -> np.ndarray:
    """Ids of the exact cosine top-k of each query among the embedder's stored vectors, read a chunk at a time."""
    best_s, best_i = np.full((len(queries), 0), -np.inf, np.float32), np.zeros((len(queries), 0), np.int64)
    for ids, vectors in iter_embeddings(session, embedder, batch=max(1, BUILD_CHUNK_BYTES // (4 * embedder.dim))):
        sims, found = brute_force(ids, vectors, queries, k)
        sims, found = np.concatenate([best_s, sims], axis=1), np.concatenate([best_i, found], axis=1)
        order = np.argsort(-sims, axis=1, kind="stable")[:, :k]
        best_s, best_i = np.take_along_axis(sims, order, axis=1), np.take_along_axis(found, order, axis=1)
    return best_i


def prepare_space(
    settings: Settings, base_model: str, options: TrainOptions, retrain: bool = False, progress: bool = True
) -> PreparedSpace:
    """Embed a space and, when it has at least 10 adapters, train W2T on it (with `options`, embed.train.TrainOptions)
    and embed it with that too (the end of `zoo quickstart`). A supervised W2T already trained on exactly the
    space's adapters is kept unless `retrain`. {"embedded": adapters in the index, "w2t": the training report,
    or the kept embedder's (with "reused": True), or None}."""
    blobs = open_blob_store(settings)
    sessions = session_factory(settings.database_url)
    reports = embed_space(sessions, blobs, settings.data_dir, base_model)
    n = int(reports[0]["total"]) if reports else 0
    new = int(reports[0]["embedded"]) if reports else 0
    trained: Mapping[str, Any] | None = None
    if n >= 10:
        trained = None if retrain else _trained_on(sessions, base_model, n)
        if trained is None:
            trained = train_space(sessions, blobs, settings.data_dir, base_model, options, progress)
            embed_space(sessions, blobs, settings.data_dir, base_model)
    return {"embedded": n, "embedded_new": new, "w2t": trained}


def _trained_on(sessions: Sessions, base_model: str, n: int) -> dict[str, object] | None:
    """The serving supervised W2T of a space, if it was trained on exactly its `n` adapters: its report."""
    with sessions() as session:
        space = find_space(session, base_model)
        e = serving_embedders(session, space.id).get(W2T) if space else None
        if e is None or e.objective == "contrastive" or (e.metrics or {}).get("n_adapters") != n:
            return None
        return {"space": base_model, "embedder_id": e.id, "objective": e.objective, "reused": True, **(e.metrics or {})}
