"""The adapter resource: an adapter page's everything (stored fields, lineage, neighbours, predictions), and its deletion."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypedDict, TypeVar

from embed.serving.engine import QueryEngine
from embed.serving.refs import StoredId
from embed.serving.resources import PredictionResource, SearchResource, predict, search
from zoo.errors import NotFoundError, NotReadyError
from zoo.limits import DEFAULT_K
from zoo.store import repository, space_adapters
from zoo.store.imputation import FromLineage, from_lineage
from zoo.store.locks import space_lock
from zoo.store.models import Adapter
from zoo.store.session import Session, Sessions, write_transaction
from zoo.store.spaces import find_space

T = TypeVar("T")


class AdapterResource(repository.AdapterDetail):
    """The adapter page's resource: everything stored, its lineage, its nearest neighbours and its predictions (each
    None when the zoo is not ready for it, with the reason in `not_ready`)."""

    duplicate_sources: list[str]
    lineage: dict[str, Any]  # zoo.store.lineage.lineage
    from_lineage: FromLineage  # the labels it inherits along its edges (none needs an embedder trained)
    space: str | None
    neighbours: SearchResource | None
    predictions: PredictionResource | None
    not_ready: list[str]


class Deletion(TypedDict):
    """What delete_adapter deleted."""

    id: int
    name: str
    deleted: bool


def adapter_resource(engine: QueryEngine, session: Session, adapter: Adapter, k: int = DEFAULT_K) -> AdapterResource:
    """The adapter page's resource: everything stored, its lineage, its nearest neighbours and its predictions
    (each None with the reason when the zoo is not ready for it)."""
    from zoo.store.lineage import lineage

    space = find_space(session, adapter.base_model)
    resource: AdapterResource = {
        **repository.adapter_detail(adapter),
        "duplicate_sources": repository.duplicate_sources(session, adapter.id),
        "lineage": lineage(session, adapter.id),
        "from_lineage": from_lineage(session, adapter.id),
        "space": space.name if space else None,
        "neighbours": None,
        "predictions": None,
        "not_ready": [],
    }
    if space is None or adapter.factors_blob is None:
        resource["not_ready"].append("not embedded: run `zoo embed`" if adapter.factors_blob else "a checkpoint without a low-rank update")
        return resource
    resource["neighbours"] = _when_ready(lambda: search(engine, session, StoredId(adapter.id), k, space.name), resource["not_ready"])
    predictions = _when_ready(lambda: predict(engine, session, StoredId(adapter.id), space.name, lineage=False), resource["not_ready"])
    if predictions is not None:
        predictions["from_lineage"] = resource["from_lineage"]  # read once above
    resource["predictions"] = predictions
    return resource


def _when_ready(call: Callable[[], T], not_ready: list[str]) -> T | None:
    """call(), or None when the zoo is not ready for it (the reason appended to not_ready)."""
    try:
        return call()
    except (NotReadyError, NotFoundError) as exc:
        not_ready.append(str(exc))
        return None


def delete_adapter(sessions: Sessions, adapter_id: int) -> Deletion:
    """Delete an adapter and everything stored with it (rows; its blob stays for `zoo check --repair`),
    leaving a tombstone under a new version of its space, so that engines and index files drop it."""
    with sessions() as session:
        base = space_adapters.base_model_of(session, adapter_id)
    if base is None:
        raise NotFoundError(f"no adapter with id {adapter_id}")
    with write_transaction(sessions, space_lock(base)) as session:
        space = find_space(session, base)
        name = space_adapters.delete_adapter(session, adapter_id, space.id if space else None)
        if name is None:
            raise NotFoundError(f"no adapter with id {adapter_id}")
    return {"id": adapter_id, "name": name, "deleted": True}
