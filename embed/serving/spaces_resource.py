"""The spaces resource: each embedding space with its serving embedders and what the query engine holds of it."""

from __future__ import annotations

from typing import NotRequired, TypedDict

from embed.serving.engine import QueryEngine
from zoo.store.embedders import serving_embedders
from zoo.store.embeddings import stored_count
from zoo.store.models import Embedder
from zoo.store.session import Session
from zoo.store.spaces import all_spaces, space_bases


class EmbedderEntry(TypedDict):
    """A serving embedder of a space: how many adapters it embeds, and how its space searches (once trained)."""

    id: int
    method: str
    objective: str | None
    dim: int
    embedded: int
    search: NotRequired[str]
    choices: NotRequired[dict[str, dict[str, object]]]


class SpaceName(TypedDict):
    name: str
    base_model: str


class SpaceEntry(SpaceName):
    """A space of the spaces resource (list_spaces)."""

    version: int
    adapters: int  # the most any of its embedders embeds
    embedders: list[EmbedderEntry]
    loaded: bool  # whether the query engine holds it loaded
    bytes: int | None  # the bytes it takes there (None: not loaded)


class SpacesResource(TypedDict):
    """The spaces, the bytes the query engine holds of them, and its budget."""

    spaces: list[SpaceEntry]
    loaded_bytes: int
    budget_bytes: int


def space_names(session: Session) -> list[SpaceName]:
    """Each space's name and base model, by name (without list_spaces' counts, which read every embedding row)."""
    return [{"name": name, "base_model": base_model} for name, base_model in space_bases(session)]


def list_spaces(session: Session, engine: QueryEngine | None = None) -> list[SpaceEntry]:
    """The spaces resource: each space with its serving embedders, how many adapters they embed (`adapters`: the
    most any of them does), whether the query engine holds the space loaded and the bytes it takes (none loaded
    without an engine)."""
    held = engine.loaded_spaces() if engine is not None else {}
    out: list[SpaceEntry] = []
    for space in all_spaces(session):
        embedders = [_embedder_entry(session, e) for e in serving_embedders(session, space.id).values()]
        adapters = max((e["embedded"] for e in embedders), default=0)
        out.append(
            {
                "name": space.name,
                "base_model": space.base_model,
                "version": space.version,
                "adapters": adapters,
                "embedders": embedders,
                "loaded": space.name in held,
                "bytes": held.get(space.name),
            }
        )
    return out


def _embedder_entry(session: Session, e: Embedder) -> EmbedderEntry:
    entry: EmbedderEntry = {"id": e.id, "method": e.method, "objective": e.objective, "dim": e.dim, "embedded": stored_count(session, e.id)}
    metrics = e.metrics or {}
    if "search" in metrics:
        entry["search"] = metrics["search"]
    if "choices" in metrics:
        entry["choices"] = metrics["choices"]
    return entry
