"""What the `zoo` commands do with embeddings: train, embed, search, predict.

Plain functions over a session, the blob store and the data dir; no printing.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from embed.baselines import SKETCH_K, dw_sketch
from embed.dataset import SpaceSchema, ZooAdapter, load_adapters, schema_of
from embed.registry import active_embedder, embedded_ids, ensure_space, get_space, open_index, register, slug, store_embeddings
from embed.similarity import hybrid_score, module_cosine_matrix
from embed.train import Embedder as W2TEmbedder
from embed.train import TrainOptions, train_w2t
from zoo.blobs import BlobStore
from zoo.db.models import Adapter, Embedder, EmbeddingSpace, Label
from zoo.errors import ZooError
from zoo.formats import read_adapter
from zoo.ingest import canonicalize_modules, pick_device

EmbedFn = Callable[[list[ZooAdapter]], np.ndarray]


@functools.lru_cache(maxsize=4)
def load_w2t(checkpoint: Path, device: str | None) -> W2TEmbedder:
    """A W2T checkpoint, loaded once per process (checkpoint directories are never rewritten)."""
    return W2TEmbedder.load(checkpoint, device)


def embed_function(embedder: Embedder, data_dir: Path, device: str | None = None) -> tuple[EmbedFn, SpaceSchema]:
    """How an embedder turns adapters into unit vectors, and the module vocabulary it was made for."""
    if embedder.method == "w2t":
        model = load_w2t(data_dir / str(embedder.checkpoint), device)
        return model.embed, model.schema
    schema = SpaceSchema.from_dict(embedder.config["schema"])
    k, seed = int(embedder.config["k"]), int(embedder.config["seed"])
    return (lambda adapters: dw_sketch(adapters, schema, k, seed).astype(np.float32)), schema


def ensure_sketch(session: Session, space: EmbeddingSpace, schema: SpaceSchema) -> Embedder:
    """The space's training-free sketch embedder (a new one if the module vocabulary grew)."""
    current = active_embedder(session, space, method="dw_sketch")
    if current is not None and SpaceSchema.from_dict(current.config["schema"]) == schema:
        return current
    dim = len(schema.modules) * SKETCH_K * SKETCH_K
    return register(session, space, "dw_sketch", dim, config={"schema": schema.as_dict(), "k": SKETCH_K, "seed": 0})


@dataclass
class EmbedReport:
    space: str
    embedder_id: int
    method: str
    embedded: int
    skipped_not_fitting: int
    total: int
    index: str


def embed_space(session: Session, blobs: BlobStore, data_dir: Path, base_model: str, device: str | None = None) -> list[EmbedReport]:
    """Embed every adapter of the space not yet embedded, under every active embedder; update the indexes."""
    adapters = load_adapters(session, blobs, base_model)
    if not adapters:
        return []
    schema = schema_of(base_model, adapters)
    space = ensure_space(session, schema)
    ensure_sketch(session, space, schema)
    reports = []
    for embedder in session.scalars(select(Embedder).where(Embedder.space_id == space.id, Embedder.active.is_(True))):
        fn, emb_schema = embed_function(embedder, data_dir, device)
        done = embedded_ids(session, embedder)
        todo = [a for a in adapters if a.id not in done and emb_schema.fits(a.factors)]
        misfits = sum(1 for a in adapters if a.id not in done and not emb_schema.fits(a.factors))
        for start in range(0, len(todo), 256):
            chunk = todo[start : start + 256]
            store_embeddings(session, embedder, [a.id for a in chunk], fn(chunk))
        session.flush()
        index, state = open_index(session, data_dir, embedder)
        reports.append(EmbedReport(base_model, embedder.id, embedder.method, len(todo), misfits, index.size, state))
    return reports


def train_space(
    session: Session, blobs: BlobStore, data_dir: Path, base_model: str, options: TrainOptions, progress: bool = True
) -> tuple[Embedder, W2TEmbedder]:
    """Train W2T on every adapter of the space (labels and measurements as given), register and save it."""
    adapters = load_adapters(session, blobs, base_model)
    if len(adapters) < 10:
        raise ZooError(f"space {base_model} has {len(adapters)} adapters: training needs at least 10")
    schema = schema_of(base_model, adapters)
    space = ensure_space(session, schema)
    t0 = time.perf_counter()
    model = train_w2t(adapters, schema, options, progress=progress)
    checkpoint = Path("embedders") / f"{slug(base_model)}-w2t-{options.objective}-{int(time.time())}"
    model.save(data_dir / checkpoint)
    best = min(h["val_loss"] for h in model.history) if model.history else None
    metrics = {
        "best_val_loss": best,
        "epochs": [sum(1 for h in model.history if h["member"] == i) for i in range(len(model.models))],
        "train_seconds": round(time.perf_counter() - t0, 1),
        "n_adapters": len(adapters),
    }
    embedder = register(
        session,
        space,
        "w2t",
        model.dim,
        objective=options.objective,
        checkpoint=str(checkpoint),
        config={"options": {k: v for k, v in options.__dict__.items() if k != "device"}, "model": model.config.as_dict()},
        metrics=metrics,
    )
    return embedder, model


def resolve_space(session: Session, requested: str | None) -> EmbeddingSpace:
    spaces = list(session.scalars(select(EmbeddingSpace).order_by(EmbeddingSpace.name)))
    if requested:
        space = get_space(session, requested)
        if space is None:
            raise ZooError(f"no embedding space {requested!r}; spaces: {', '.join(s.name for s in spaces) or 'none (run `zoo embed`)'}")
        return space
    if len(spaces) != 1:
        names = ", ".join(s.name for s in spaces) or "none yet: run `zoo embed`"
        raise ZooError(f"--space is needed: this zoo has {len(spaces)} embedding spaces ({names})")
    return spaces[0]


def query_adapter(session: Session, blobs: BlobStore, id_or_path: str, device: str | None = None) -> tuple[ZooAdapter, str | None]:
    """(adapter, its base model) for a stored id, or a path read and canonicalized without storing it."""
    if id_or_path.isdigit() and not Path(id_or_path).exists():
        a = session.get(Adapter, int(id_or_path))
        if a is None or a.factors_blob is None:
            raise ZooError(f"no LoRA adapter with id {id_or_path}: see `zoo list`")
        labels = {lb.key: lb.value for lb in session.scalars(select(Label).where(Label.adapter_id == a.id, Label.source == "given"))}
        return ZooAdapter(a.id, a.name, dict(blobs.get_factors(a.factors_blob)), labels, {}, a.source_uri), a.base_model
    data = read_adapter(Path(id_or_path))
    if not data.modules:
        raise ZooError(f"{id_or_path}: a full checkpoint without --base has no low-rank update to search with")
    factors = canonicalize_modules(data.modules, pick_device(device))
    return ZooAdapter(-1, data.path.name, {m.name: f for m, f in zip(data.modules, factors, strict=True)}), data.base_model


@dataclass
class Hit:
    adapter_id: int
    name: str
    score: float
    labels: dict[str, str]


#: Search methods. hybrid: exact module cosine and the supervised W2T embedding's cosine, mixed by
#: the weight chosen on the validation adapters in training, over the union of both indexes'
#: RERANK_POOL nearest; module: the sketch index's RERANK_POOL nearest ranked by exact module
#: cosine (embed/similarity.py); sketch and w2t: their embeddings alone. The default is hybrid
#: once a supervised W2T is trained, module before.
SEARCH_METHODS = ("hybrid", "module", "sketch", "w2t")
RERANK_POOL = 200


@dataclass
class SearchResult:
    hits: list[Hit]
    method: str
    embedder_ids: list[int]


def default_search_method(session: Session, space: EmbeddingSpace) -> str:
    w2t = active_embedder(session, space, method="w2t")
    return "hybrid" if w2t is not None and w2t.objective != "contrastive" else "module"


def search(
    session: Session,
    blobs: BlobStore,
    data_dir: Path,
    space: EmbeddingSpace,
    query: ZooAdapter,
    k: int,
    filters: dict[str, str],
    device: str | None = None,
    method: str | None = None,
) -> SearchResult:
    method = method or default_search_method(session, space)
    if method not in SEARCH_METHODS:
        raise ZooError(f"unknown search method {method!r}; one of {', '.join(SEARCH_METHODS)}")
    uses = {"hybrid": ("dw_sketch", "w2t"), "module": ("dw_sketch",), "sketch": ("dw_sketch",), "w2t": ("w2t",)}[method]
    embedders = [_embedder_for(session, space, m, method) for m in uses]
    want = k + (1 if query.id > 0 else 0)
    exact = method in ("hybrid", "module")
    pool: dict[int, float] = {}
    query_vector = np.zeros(0)
    for embedder in embedders:
        fn, schema = embed_function(embedder, data_dir, device)
        if not schema.fits(query.factors):
            raise ZooError(f"{query.name} does not fit space {space.name}: its modules or shapes differ from the space's")
        index, _ = open_index(session, data_dir, embedder)
        query_vector = fn([query])  # the hybrid's last embedder is W2T: its query vector is reused below
        fetch = index.size if filters else (max(want, RERANK_POOL) if exact else want)
        scores, ids = index.search(query_vector, fetch)
        found = [(int(i), float(sc)) for sc, i in zip(scores[0], ids[0], strict=True) if i >= 0 and i != query.id]
        if filters:
            found = [(i, sc) for i, sc in found if _matches(session, i, filters)]
        for i, sc in found[: max(RERANK_POOL, want)] if exact else found:
            pool.setdefault(i, sc)
    if exact:
        w2t = (load_w2t(data_dir / str(embedders[1].checkpoint), device), query_vector) if method == "hybrid" else None
        pairs = _rescore(session, blobs, query, list(pool), w2t)
    else:
        pairs = sorted(((sc, i) for i, sc in pool.items()), key=lambda p: -p[0])
    hits: list[Hit] = []
    for score, adapter_id in pairs[:k]:
        a = session.get(Adapter, adapter_id)
        hits.append(Hit(adapter_id, a.name if a else "?", score, _given_labels(session, adapter_id)))
    return SearchResult(hits, method, [e.id for e in embedders])


def _embedder_for(session: Session, space: EmbeddingSpace, kind: str, method: str) -> Embedder:
    embedder = active_embedder(session, space, method=kind)
    if embedder is None:
        todo = "zoo train" if kind == "w2t" else "zoo embed"
        raise ZooError(f"space {space.name} has no {kind} embeddings yet for --method {method}: run `{todo} --space {space.name}`")
    if method == "hybrid" and kind == "w2t" and embedder.objective == "contrastive":
        raise ZooError(f"--method hybrid needs a supervised W2T: run `zoo train --space {space.name}`")
    return embedder


def _given_labels(session: Session, adapter_id: int) -> dict[str, str]:
    return {lb.key: lb.value for lb in session.scalars(select(Label).where(Label.adapter_id == adapter_id, Label.source == "given"))}


def _matches(session: Session, adapter_id: int, filters: dict[str, str]) -> bool:
    labels = _given_labels(session, adapter_id)
    return all(labels.get(key) == value for key, value in filters.items())


def _rescore(
    session: Session, blobs: BlobStore, query: ZooAdapter, pool: list[int], w2t: tuple[W2TEmbedder, np.ndarray] | None
) -> list[tuple[float, int]]:
    """The pool ranked by exact module cosine, or by the hybrid score given W2T and the query's W2T vector."""
    found = {a.id: a for a in session.scalars(select(Adapter).where(Adapter.id.in_(pool))) if a.factors_blob}
    candidates = [ZooAdapter(i, found[i].name, dict(blobs.get_factors(str(found[i].factors_blob)))) for i in pool if i in found]
    scores = module_cosine_matrix([query.factors], [c.factors for c in candidates])[0]
    if w2t is not None:
        model, query_vector = w2t
        scores = hybrid_score(scores, (model.embed(candidates) @ query_vector.T)[:, 0], model.hybrid_weight)
    return sorted(zip(scores.tolist(), [c.id for c in candidates], strict=True), key=lambda p: -p[0])


def predict(
    session: Session, blobs: BlobStore, data_dir: Path, space: EmbeddingSpace, query: ZooAdapter, device: str | None = None
) -> tuple[dict[str, list[tuple[str, float]]], dict[str, tuple[float, float, float, str]], Embedder]:
    """Top class probabilities per attribute, and (value, low, high, predictor) per metric (a 90 % interval)."""
    embedder = active_embedder(session, space, method="w2t")
    if embedder is None or embedder.objective == "contrastive":
        raise ZooError(f"space {space.name} has no supervised W2T embedder: run `zoo train --space {space.name}`")
    model = load_w2t(data_dir / str(embedder.checkpoint), device)
    if not model.schema.fits(query.factors):
        raise ZooError(f"{query.name} does not fit space {space.name}")
    probs, values = model.predict([query])
    attrs = {}
    for key, p in probs.items():
        classes = model.config.categorical[key]
        order = np.argsort(-p[0])[:3]
        attrs[key] = [(classes[i], float(p[0][i])) for i in order]
    metrics = {}
    for key, v in values.items():
        half = 1.645 * model.residual_std.get(key, float("nan"))
        low, high = model.metric_range.get(key, (-math.inf, math.inf))
        metrics[key] = (float(v[0]), max(float(v[0] - half), low), min(float(v[0] + half), high), model.predictor.get(key, "head"))
    return attrs, metrics, embedder
