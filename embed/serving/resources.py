"""The query resources: search and prediction for a stored adapter or a file, as the `zoo` commands' `--json`, the
REST API and the HTML pages show them (one plain dict each; no printing), and the space a command works on.

Plain functions over a session, the blob store and the query engine. The other resources have modules of their own:
`embed/serving/embedding_resource.py` (`zoo embed`), `embed/training/training_resource.py` (`zoo train`, `zoo quickstart`),
`embed/serving/index_resource.py` (`zoo index`), `embed/serving/adapter_resource.py` and `embed/serving/spaces_resource.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from embed.data.dataset import base_models
from embed.serving.engine import QueryEngine
from embed.serving.refs import AdapterRef, StoredId
from embed.serving.results import Found, Predicted, Query
from zoo.domain.base_models import guess_base_model
from zoo.errors import NotFoundError, SpaceNotFoundError, UsageError
from zoo.store import space_adapters
from zoo.store.blobs import BlobStore
from zoo.store.imputation import FromLineage, from_lineage
from zoo.store.labels import given_labels
from zoo.store.models import EmbeddingSpace
from zoo.store.session import Session
from zoo.store.spaces import all_spaces, find_space, get_space, space_base_model

if TYPE_CHECKING:
    from zoo.formats import AdapterData


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
