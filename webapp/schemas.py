"""Request and response schemas of the REST API (they also make its OpenAPI document).

The schemas of the resources that zoo and embed type as TypedDicts are derived from them (typed_schema), so that a
resource has one description; the others are written here.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from typing import Any, NotRequired, Union, cast, get_args, get_origin, get_type_hints, is_typeddict

from apiflask import Schema
from apiflask.fields import Boolean, Dict, Field, File, Float, Integer, List, Nested, Raw, String
from apiflask.validators import Length, OneOf, Range

from embed.serving.adapter_resource import AdapterResource, Deletion
from embed.serving.maps import MapResource
from embed.serving.resources import PredictionResource, SearchResource
from embed.serving.search_methods import SEARCH_METHODS
from embed.serving.spaces_resource import SpacesResource
from webapp.errors import ERROR_TYPES
from zoo.limits import DEFAULT_K, DEFAULT_MAP_POINTS, DEFAULT_PER_PAGE, MAX_K, MAX_MAP_POINTS, MAX_PAGE, MAX_PER_PAGE, MAX_PREDICTION_IDS
from zoo.services.export import FORMATS
from zoo.store.catalog import CatalogPage
from zoo.store.labels import AdapterLabels
from zoo.store.relations import FromWeights

#: the largest id an SQL INTEGER key holds (PostgreSQL's int4); larger ones overflow in the database driver
MAX_ID = 2**31 - 1


_SCALARS: dict[object, type[Field]] = {str: String, int: Integer, float: Float, bool: Boolean, object: Raw, Any: Raw}


def typed_fields(resource: type) -> dict[str, Field]:
    """A field per key of a TypedDict: required unless NotRequired, nullable where its type admits None; lists, dicts
    (string keys) and nested TypedDicts (typed_schema) as such, a union of TypedDicts (one of several shapes) as an
    object, a union of other types as Raw."""
    return {key: _field(hint, required=True) for key, hint in get_type_hints(resource, include_extras=True).items()}


@functools.cache
def typed_schema(resource: type) -> type[Schema]:
    """The schema of a TypedDict resource, one per TypedDict (its OpenAPI component, named after it)."""
    return named_schema(resource.__name__, typed_fields(resource))


def named_schema(name: str, fields: Mapping[str, Field]) -> type[Schema]:
    """A schema of these fields, the OpenAPI component `name`."""
    # marshmallow types from_dict's class as its own Schema; it is a subclass of apiflask's
    return cast(type[Schema], Schema.from_dict(dict(fields), name=name))


def _field(hint: Any, **kwargs: Any) -> Field:
    origin, args = get_origin(hint), get_args(hint)
    if origin is NotRequired:
        return _field(args[0], **kwargs | {"required": False})
    if origin in (Union, types.UnionType):
        present = [a for a in args if a is not types.NoneType]
        one = present[0] if len(present) == 1 else dict[str, object] if all(map(is_typeddict, present)) else object
        return _field(one, **kwargs | {"allow_none": len(present) < len(args)})
    if origin is list or hint is list:
        return List(_field(args[0] if args else object), **kwargs)
    if origin is dict or hint is dict:
        return Dict(keys=String(), values=_field(args[1]), **kwargs) if args else Dict(**kwargs)
    if is_typeddict(hint):
        return Nested(typed_schema(hint), **kwargs)
    if hint in _SCALARS:
        return _SCALARS[hint](**kwargs)
    raise TypeError(f"no schema field for {hint!r}")


FILTER_DOC = (
    "key=value, repeatable: base_model, format, rank, source (prefix), author, license, pipeline_tag, library, "
    "base_model_relation, relation (found from the weights: merge, rescaled, ...), derived_from (an adapter id), or a label; "
    "label.key=value is always the label (label.rank=8: a label named like a field)"
)
SPACE_DOC = "the space to search (default: the space of the query's base model)"


class Filters(Schema):
    filter = List(String(), load_default=list, metadata={"description": FILTER_DOC})


class CatalogQuery(Filters):
    q = String(
        load_default=None,
        validate=Length(max=1000),
        metadata={"description": "free text: names, base model, labels, tags, author, datasets, pipeline tag, card"},
    )
    sort = String(load_default=None, validate=OneOf(("relevance", "name", "newest", "rank")))
    page = Integer(load_default=1, validate=Range(1, MAX_PAGE))
    per_page = Integer(load_default=DEFAULT_PER_PAGE, validate=Range(1, MAX_PER_PAGE))
    space = String(load_default=None, metadata={"description": "only adapters of this embedding space (its base model)"})
    semantic = Boolean(
        load_default=False,
        metadata={
            "description": "rank by meaning (the search page's default): q's sentence against each adapter's text and predicted "
            "attributes, fused with full text, plus weight-space neighbours of the text hits; each result says why it matched"
        },
    )


class SimilarQuery(Filters):
    k = Integer(load_default=DEFAULT_K, validate=Range(1, MAX_K))
    space = String(load_default=None, metadata={"description": SPACE_DOC})
    method = String(load_default=None, validate=OneOf(SEARCH_METHODS))


class SimilarOptions(Schema):
    """The upload search's parameters (SimilarQuery's), each in the query string or in the form: without defaults
    here, so that the view sees where each came (in both, the values must agree) and applies SimilarQuery's."""

    k = Integer(validate=Range(1, MAX_K), metadata={"default": DEFAULT_K, "description": "in the query string or the form"})
    space = String(metadata={"description": f"{SPACE_DOC}; in the query string or the form"})
    method = String(validate=OneOf(SEARCH_METHODS), metadata={"description": "in the query string or the form"})
    filter = List(String(), metadata={"description": f"{FILTER_DOC}; in the query string or the form"})


class SimilarUpload(SimilarOptions):
    file = List(File(), required=True, metadata={"description": "a PEFT directory's two files, a zip of one, or one LoRA .safetensors"})


class DownloadQuery(Schema):
    format = String(load_default="peft", validate=OneOf(FORMATS))


class PredictBody(Schema):
    adapter_id = Integer(validate=Range(1, MAX_ID))
    adapter_ids = List(Integer(validate=Range(1, MAX_ID)), validate=Length(1, MAX_PREDICTION_IDS))
    space = String(load_default=None)


class IngestBody(Schema):
    paths = List(String(validate=Length(1, 4096)), validate=Length(1, 10_000), metadata={"description": "paths under the import root"})
    base_model = String(load_default=None)


class ErrorDetail(Schema):
    status = Integer(required=True)
    type = String(
        required=True,
        validate=OneOf(list(ERROR_TYPES)),
        metadata={"description": "what went wrong, one of a fixed set: " + ", ".join(f"{k} ({s})" for k, (s, _) in ERROR_TYPES.items())},
    )
    message = String(required=True)
    detail = Raw(required=True, allow_none=True)


class Error(Schema):
    """Every error the API answers (webapp/errors.py), validation errors included."""

    error = Nested(ErrorDetail, required=True)


class Health(Schema):
    status = String()
    database = String()
    adapters = Integer()
    schema = String(allow_none=True)
    version = String()


class JobItem(Schema):
    id = Integer()
    source = String()
    state = String(metadata={"description": "queued, running, done, duplicate, failed or cancelled"})
    reason = String(allow_none=True, metadata={"description": "why it failed (or the error of an attempt that will be retried)"})
    attempts = Integer()
    adapter_id = Integer(allow_none=True, metadata={"description": "the adapter stored, or found to be the same (duplicate)"})
    lease_owner = String(allow_none=True, metadata={"description": "the worker (host:pid:thread) holding a running item"})
    started_at = String(allow_none=True)
    timings = Dict(keys=String(), values=Float(), allow_none=True, metadata={"description": "seconds per ingest stage"})
    warnings = List(
        String(), metadata={"description": "what ingest warned of though it stored the source (a base model its module shapes contradict)"}
    )
    notes = List(String(), metadata={"description": "ingest's notes on the source (the base model guessed from its shapes, ...)"})


class Job(Schema):
    id = Integer()
    kind = String()
    state = String(metadata={"description": "queued, running, done or cancelled"})
    created_by = String(allow_none=True)
    created_at = String(allow_none=True)
    finished_at = String(allow_none=True)
    counts = Dict(keys=String(), values=Integer(), metadata={"description": "items per state, and total"})
    processed = Integer(metadata={"description": "items done, duplicate or failed"})
    elapsed_s = Float(allow_none=True, metadata={"description": "seconds since the first claim (to the last finish once done)"})
    throughput = Float(allow_none=True, metadata={"description": "items processed per second over elapsed_s"})
    eta_s = Float(allow_none=True, metadata={"description": "seconds until the queued and running items are done, at that rate"})
    stages = Dict(keys=String(), values=Float(), metadata={"description": "mean seconds per ingest stage over the latest items"})
    slowest_stage = String(allow_none=True)
    items = List(Nested(JobItem), metadata={"description": "the first 1000 items (failed ones first), by id"})


class JobList(Schema):
    jobs = List(Nested(Job(exclude=("stages", "slowest_stage", "items"))), metadata={"description": "the newest 50 jobs, newest first"})


class MapQuery(Schema):
    color_by = String(load_default=None, metadata={"description": "a label key, or metric:<name>"})
    limit = Integer(load_default=DEFAULT_MAP_POINTS, validate=Range(1, MAX_MAP_POINTS))
    highlight = List(Integer(validate=Range(1, MAX_ID)), load_default=list, metadata={"description": "ids always drawn"})


class LabelsBody(Schema):
    """Labels and measurements to set; past the label limits (zoo.labels.label_problem, settings ZOO_MAX_LABEL_*) a 413."""

    labels = Dict(keys=String(validate=Length(1, 128)), values=String(validate=Length(min=1)), load_default=dict)
    measurements = Dict(keys=String(validate=Length(1, 128)), values=Float(allow_nan=False), load_default=dict)


class AdapterRef(Schema):
    id = Integer()
    name = String()
    author = String(allow_none=True)
    base_model = String()
    source_uri = String()
    source_revision = String(allow_none=True)
    created_at = String(allow_none=True)
    last_modified = String(allow_none=True)


class LineageAdapter(AdapterRef):
    relation = String(allow_none=True)


class BaseModelNode(Schema):
    model = String()
    relation = String(allow_none=True, metadata={"description": "what the model below is of this one: adapter, finetune, merge, quantized"})
    adapter_id = Integer(allow_none=True, metadata={"description": "the stored adapter from hf://<model>"})
    described_by = String(allow_none=True, metadata={"description": "stored (an adapter's metadata), recorded (the source's tree) or none"})
    cycle = Boolean()
    truncated = Boolean()
    base_models = List(Nested(lambda: BaseModelNode()))


class Versions(Schema):
    older = List(Nested(AdapterRef), metadata={"description": "previous versions, nearest first"})
    newer = List(Nested(AdapterRef), metadata={"description": "later versions, nearest first"})


class RelatedAdapters(Schema):
    value = String(allow_none=True)
    total = Integer(metadata={"description": "other adapters with this value (counted up to a cap)"})
    capped = Boolean()
    adapters = List(Nested(AdapterRef), metadata={"description": "the newest of them"})


class Lineage(Schema):
    adapter = Nested(LineageAdapter)
    base_models = List(Nested(BaseModelNode))
    versions = Nested(Versions)
    same_base_model = Nested(RelatedAdapters)
    same_author = Nested(RelatedAdapters)
    same_source = Nested(RelatedAdapters)
    from_weights = Nested(
        typed_schema(FromWeights),
        metadata={
            "description": "relations found from the weights: `parents` (what it derives from), `children` (what derives from it), "
            "each with its relation (identical, rescaled, cast, truncated, pruned, merge, continuation), parameters, evidence "
            "and confidence; its scan; where its card's base_model_relation disagrees"
        },
    )
    limit = Integer()


SearchOut = typed_schema(SearchResource)
#: the adapter page's resource; its lineage is the lineage resource
AdapterOut = named_schema("AdapterResource", {**typed_fields(AdapterResource), "lineage": Nested(Lineage, required=True)})
CatalogOut = typed_schema(CatalogPage)
LabelsOut = typed_schema(AdapterLabels)
DeletionOut = typed_schema(Deletion)
SpacesOut = typed_schema(SpacesResource)
#: the map as the API serves it (`zoo map` adds the map file's path)
MapOut = named_schema("MapResource", {k: f for k, f in typed_fields(MapResource).items() if k != "file"})
#: what each predict endpoint keeps of a prediction: the query, and attributes with their confidence (labelled
#: neighbours that agree, "sure" or not) and what a stored adapter inherits along its edges, or metrics
PREDICTION_KEYS = {
    "attributes": ("query", "query_name", "stored_as", "space", "embedder_id", "predictors", "attributes", "confidence", "from_lineage"),
    "metrics": ("query", "query_name", "stored_as", "space", "embedder_id", "predictors", "metrics"),
}


def _predictions(name: str, part: str) -> type[Schema]:
    fields = typed_fields(PredictionResource)
    one = named_schema(f"{name}Prediction", {k: fields[k] for k in PREDICTION_KEYS[part]})
    return named_schema(f"{name}Predictions", {"predictions": List(Nested(one), required=True)})


AttributesOut = _predictions("Attribute", "attributes")
PerformanceOut = _predictions("Performance", "metrics")
