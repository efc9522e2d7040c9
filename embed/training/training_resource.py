"""Training W2T on a space (`zoo train`), and a space made ready to serve (`zoo quickstart`: embedded, then W2T trained
and embedded with). Each returns a plain dict, one per resource, that `--json` prints."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from embed.serving.embedding_resource import chunk_size, embed_space, stored_schema
from embed.serving.search_methods import W2T
from zoo.config import Settings
from zoo.errors import NotReadyError
from zoo.store import space_adapters
from zoo.store.blob_backends import open_blob_store
from zoo.store.blobs import BlobStore
from zoo.store.embedders import register, serving_embedders
from zoo.store.locks import space_lock
from zoo.store.session import Sessions, session_factory, write_transaction
from zoo.store.shared_files import publish
from zoo.store.spaces import ensure_space, find_space

if TYPE_CHECKING:
    from embed.training.train import TrainOptions


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


def slug(name: str) -> str:
    """The name as a file name's part: runs of other characters than letters, digits, `.`, `_` and `-` made `_`."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "space"


def train_space(
    sessions: Sessions, blobs: BlobStore, data_dir: Path, base_model: str, options: TrainOptions, progress: bool = True
) -> TrainReport:
    """Train W2T on the adapters of the space that fit it (labels and measurements as given), save it
    under a name no other training uses, and register it. No transaction is open while it trains.

    The adapters are read a chunk at a time (as `zoo embed` reads them) and held only as W2T's tokens, projected to
    the options' token width as they are read, with the exact scores among the labelled from a module stack, or
    from module sketches where the space's module store would pass its budget (as the engine then serves them)."""
    from embed.data.dataset import read_training_set
    from embed.data.tokens import torch_threads
    from embed.serving.budgets import module_store_budget
    from embed.serving.module_store import layout_bytes, module_layout
    from embed.training.train import token_spec, train_w2t

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


def prepare_space(
    settings: Settings, base_model: str, options: TrainOptions, retrain: bool = False, progress: bool = True
) -> PreparedSpace:
    """Embed a space and, when it has at least 10 adapters, train W2T on it (with `options`, embed.training.train.TrainOptions)
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
