"""The REST API, `/api/v1`: JSON twins of the pages, and the calls programs make.

Views parse, call zoo/embed, and return the resource dict; no math or SQL here. Expensive calls
(uploads, predictions) run under the app's time limit with a session of their own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

from apiflask import APIBlueprint, abort
from flask import Response, jsonify, request
from werkzeug.exceptions import UnsupportedMediaType

from embed.serving import adapter_resource, resources, spaces_resource
from embed.serving.budgets import spaces_budget
from embed.serving.refs import StoredId
from webapp import schemas
from webapp.auth import current_token, needs
from webapp.context import db, retry_after, zoo_context
from webapp.shared import get_adapter, ids_in_range, limited_upload, refuse_invalid_json, refuse_nul, space_filters, with_session
from zoo import __version__, deadline
from zoo.errors import NotFoundError, UsageError
from zoo.store import repository
from zoo.store.session import current_revision

if TYPE_CHECKING:
    from zoo.store.catalog import CatalogPage
    from zoo.store.job_resources import JobDetail, JobSummary
    from zoo.store.labels import AdapterLabels

api = APIBlueprint("api", __name__, url_prefix="/api/v1", tag="zoo")


class HealthResource(TypedDict):
    status: str
    database: str
    adapters: int
    schema: str | None  # the database's migration revision
    version: str


api.url_value_preprocessor(ids_in_range)
T = TypeVar("T")

# Error statuses the OpenAPI document lists besides apiflask's own (404 with a path parameter, 422 with an input,
# 401 with auth): 400 usage (a bad filter or argument), 401 for reads under ZOO_READ_TOKEN_REQUIRED, 409 not ready
# (no embedding or W2T yet), 413/415 an upload too large or of the wrong type, 503 past the time limit. A list
# replaces apiflask's automatic 200, so views without @api.output list theirs.
READ = [400, 401]
ENGINE = [*READ, 404, 409]
UPLOAD = [400, 401, 404, 409, 413, 415, 422, 503]
#: a download's notes: what the export lacks (zoo.services.export.export_notes), as a JSON list
NOTES_HEADER = "X-Zoo-Export-Notes"


@api.get("/health")
@api.output(schemas.Health)
def health() -> HealthResource:
    """Liveness and the database's state."""
    count = repository.adapter_count(db())
    return {
        "status": "ok",
        "database": "ok",
        "adapters": count,
        "schema": current_revision(zoo_context().settings.database_url),
        "version": __version__,
    }


@api.get("/adapters")
@needs("read")
@api.input(schemas.CatalogQuery, location="query", arg_name="query")
@api.output(schemas.CatalogOut)
@api.doc(responses=[*READ, 404])
def adapters(query: dict) -> CatalogPage:
    """Search the catalog: free text (or, with `semantic`, by meaning), facets with counts, sorting, pages."""
    from zoo.store.catalog import search_catalog

    filters = space_filters(db(), query["space"], repository.parse_filters(query["filter"]))
    if query["semantic"]:
        from embed.serving.text_search import search_by_meaning

        return search_by_meaning(db(), zoo_context().engine, query["q"], filters, query["sort"], query["page"], query["per_page"])
    return search_catalog(db(), query["q"], filters, query["sort"], query["page"], query["per_page"])


@api.get("/adapters/<int:adapter_id>")
@needs("read")
@api.output(schemas.AdapterOut)
@api.doc(responses=ENGINE)
def adapter(adapter_id: int) -> Response:
    """Everything stored about an adapter, its neighbours and its predictions (the adapter page's twin)."""
    # plain JSON already: the schema's dump would only add time, per module and singular value
    return jsonify(adapter_resource.adapter_resource(zoo_context().engine, db(), get_adapter(adapter_id, with_modules=True)))


@api.get("/adapters/<int:adapter_id>/lineage")
@needs("read")
@api.output(schemas.Lineage)
@api.doc(responses=[*READ, 404])
def lineage(adapter_id: int) -> dict[str, object]:
    """The adapter's base-model tree, its versions, and the adapters of the same base model, author and source."""
    from zoo.store.lineage import lineage as adapter_lineage

    return adapter_lineage(db(), adapter_id)


@api.get("/adapters/<int:adapter_id>/similar")
@needs("read")
@api.input(schemas.SimilarQuery, location="query", arg_name="query")
@api.output(schemas.SearchOut)
@api.doc(responses=[*ENGINE, 503])  # 503: the pool for searches full, or past the time limit
def similar(adapter_id: int, query: dict) -> Response:
    """The k stored adapters most similar to this one (the `Server-Timing` header gives the engine's share). Every k
    runs in a bounded pool (`ZooContext.searches`): 32 clients asking k = 10 held every request thread."""
    start = time.perf_counter()
    filters = repository.parse_filters(query["filter"])
    ctx = zoo_context()
    engine, k, space, method = ctx.engine, query["k"], query["space"], query["method"]
    found = ctx.limited(with_session(lambda s: resources.search(engine, s, StoredId(adapter_id), k, space, filters, method)), ctx.searches)
    response = jsonify(found)  # the hot path: the resource is already plain JSON, so skip the schema's dump
    response.headers["Server-Timing"] = f"engine;dur={(time.perf_counter() - start) * 1e3:.3f}"
    return response


@api.post("/similar")
@needs("read")
@api.input(schemas.SimilarOptions, location="query", arg_name="query")
@api.input(schemas.SimilarUpload, location="form_and_files", arg_name="form")
@api.output(schemas.SearchOut)
@api.doc(responses=UPLOAD)
def similar_upload(query: dict, form: dict) -> resources.SearchResource:
    """The stored adapters most similar to an uploaded one (read and canonicalized in memory, never stored). k, space,
    method and filter may come in the query string, as for GET /adapters/{id}/similar, or in the form."""
    options = agreed_options(query, form, schemas.SimilarQuery().load({}))
    filters = repository.parse_filters(options["filter"])
    engine, k, space, method = zoo_context().engine, options["k"], options["space"], options["method"]
    return limited_upload(form["file"], lambda s, upload: resources.search(engine, s, upload, k, space, filters, method))


def agreed_options(query: Mapping[str, Any], form: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Each option from the query string or the form, wherever it came, else its default; one given in both with
    two values is a 422 naming it (never one silently chosen)."""
    clash = sorted(key for key in defaults if key in query and key in form and query[key] != form[key])
    if clash:
        said = "; ".join(f"{key} is {query[key]!r} in the query string but {form[key]!r} in the form" for key in clash)
        detail = {key: ["given in the query string and the form, with two values"] for key in clash}
        abort(422, f"{said}: send each once, in either", detail=detail)
    return {key: query.get(key, form.get(key, default)) for key, default in defaults.items()}


#: what names the query of a prediction: one of these (an upload is `file`)
QUERY_FIELDS = ("adapter_id", "adapter_ids", "file")


def one_query(body: Mapping[str, object], files: Sequence[object]) -> None:
    """A prediction names its adapters one way: adapter_id, adapter_ids or an upload in `file`; two are a 422 naming
    them, not one silently preferred."""
    given = [name for name in QUERY_FIELDS if (files if name == "file" else body.get(name) is not None)]
    if len(given) > 1:
        message = f"send one of adapter_id, adapter_ids or an upload in `file`, not {' and '.join(given)} together"
        abort(422, message, detail={name: [f"sent with {' and '.join(g for g in given if g != name)}"] for name in given})


def _predict(part: str, body: dict) -> dict[str, object]:
    engine = zoo_context().engine
    files = request.files.getlist("file")
    one_query(body, files)
    found: Sequence[Mapping[str, object]]
    if files:
        found = [limited_upload(files, lambda s, upload: resources.predict(engine, s, upload, body.get("space")))]
    else:
        ids = body.get("adapter_ids") or ([body["adapter_id"]] if body.get("adapter_id") else [])
        if not ids:
            raise UsageError("send adapter_id, adapter_ids, or an upload in the `file` field")
        found = zoo_context().limited(
            # what a stored adapter inherits is served with its attributes only
            with_session(
                lambda s: [_checked(resources.predict, engine, s, StoredId(i), body.get("space"), part == "attributes") for i in ids]
            )
        )
    return {"predictions": [{k: p[k] for k in schemas.PREDICTION_KEYS[part]} for p in found]}


def _checked(fn: Callable[..., T], *args: object) -> T:
    """fn(*args) once the call's deadline is not past (a loop's step in the pool: see zoo/deadline.py)."""
    deadline.check()
    return fn(*args)


@api.post("/predict/attributes")
@needs("read")
@api.input(schemas.PredictBody, location="json_or_form", arg_name="body")
@api.output(schemas.AttributesOut)
@api.doc(responses=UPLOAD)
def predict_attributes(body: dict) -> dict[str, object]:
    """Predicted attributes of stored adapters, or of an upload (`file`): the top classes with calibrated probabilities
    and the labelled neighbours that have each, and per attribute its confidence (`sure`: the top class is at least
    50 % likely and most of its labelled neighbours agree); for a stored adapter, `from_lineage`: the given labels it
    inherits along the relations found from its weights (null for an upload, which has no edges)."""
    return _predict("attributes", body)


@api.post("/predict/performance")
@needs("read")
@api.input(schemas.PredictBody, location="json_or_form", arg_name="body")
@api.output(schemas.PerformanceOut)
@api.doc(responses=UPLOAD)
def predict_performance(body: dict) -> dict[str, object]:
    """Predicted performance (value with a 90 % interval) of stored adapters, or of an upload (`file`)."""
    return _predict("metrics", body)


@api.get("/adapters/<int:adapter_id>/download")
@needs("read")
@api.input(schemas.DownloadQuery, location="query", arg_name="query")
# apiflask types the dict's values all alike; each may be a description (an error: with the error schema) or a whole response
@api.doc(
    responses={  # type: ignore[arg-type]
        200: {"description": f"a zip (peft) or a .safetensors file; the {NOTES_HEADER} header: what the export lacks, a JSON list"},
        400: "Bad Request",
        401: "Unauthorized",
    }
)
def download(adapter_id: int, query: dict) -> Response:
    """The adapter rebuilt from its canonical form as a PEFT directory (zip), a diffusers or a kohya file; what it
    lacks (a head whose source file is gone, names kept) in the X-Zoo-Export-Notes header, as `zoo export` says it."""
    from zoo.services.export import export_files, export_notes, export_zip, file_stem, load_for_export

    factors, meta = load_for_export(db(), zoo_context().blobs, adapter_id)
    fmt = query["format"]
    if fmt == "peft":
        body, name, mime = export_zip(factors, meta), f"{file_stem(meta)}-peft.zip", "application/zip"
    else:
        ((filename, body),) = export_files(factors, meta, fmt).items()
        name, mime = filename, "application/octet-stream"
    notes = json.dumps(export_notes(meta, fmt))  # ASCII: non-ASCII characters escaped
    return Response(body, mimetype=mime, headers={"Content-Disposition": f'attachment; filename="{name}"', NOTES_HEADER: notes})


@api.put("/adapters/<int:adapter_id>/labels")
@needs("write")
@api.input(schemas.LabelsBody, location="json", arg_name="body")
@api.output(schemas.LabelsOut)
@api.doc(responses=[400, 403, 413, 415])
def set_labels(adapter_id: int, body: dict) -> AdapterLabels:
    """Set given labels and test measurements (replacing those with the same key), within the label limits (413 past
    them); needs a token of scope write."""
    from zoo.store.labels import write_labels
    from zoo.store.session import write_transaction

    if not body["labels"] and not body["measurements"]:
        raise UsageError("send labels and/or measurements to set")
    get_adapter(adapter_id)
    with write_transaction(zoo_context().sessions) as session:
        write_labels(session, adapter_id, body["labels"], body["measurements"])
    return _labels_of(adapter_id)


@api.delete("/adapters/<int:adapter_id>/labels/<path:key>")
@needs("write")
@api.output(schemas.LabelsOut)
@api.doc(responses=[403, 404])
def remove_label(adapter_id: int, key: str) -> AdapterLabels:
    """Remove a given label and the test measurement of that key (404 when it has neither); needs a token of scope
    write."""
    from zoo.store.labels import remove_label as remove
    from zoo.store.session import write_transaction

    get_adapter(adapter_id)
    with write_transaction(zoo_context().sessions) as session:
        if not remove(session, adapter_id, key):
            raise NotFoundError(f"adapter {adapter_id} has no label or measurement {key!r}")
    return _labels_of(adapter_id)


def _labels_of(adapter_id: int) -> AdapterLabels:
    """The adapter's labels and measurements as just committed (the request's read transaction ended first)."""
    db().rollback()
    detail = repository.adapter_detail(get_adapter(adapter_id))
    return {"id": adapter_id, "labels": detail["labels"], "measurements": detail["measurements"]}


@api.delete("/adapters/<int:adapter_id>")
@needs("admin")
@api.output(schemas.DeletionOut)
@api.doc(responses=[403, 404])
def delete_adapter(adapter_id: int) -> adapter_resource.Deletion:
    """Delete an adapter (its rows, labels and embeddings; it leaves every index); needs a token of scope admin."""
    return adapter_resource.delete_adapter(zoo_context().sessions, adapter_id)


@api.get("/spaces")
@needs("read")
@api.output(schemas.SpacesOut)
@api.doc(responses=READ)
def spaces() -> spaces_resource.SpacesResource:
    """Embedding spaces (one per base model) and their serving embedders; whether this process's query engine holds
    each loaded and the bytes it takes, within `budget_bytes` (ZOO_SPACES_BYTES: least recently used spaces are dropped)."""
    listed = spaces_resource.list_spaces(db(), zoo_context().engine)
    return {"spaces": listed, "loaded_bytes": sum(s["bytes"] or 0 for s in listed), "budget_bytes": spaces_budget()}


@api.get("/spaces/<path:name>/map")
@needs("read")
@api.input(schemas.MapQuery, location="query", arg_name="query")
@api.output(schemas.MapOut)
@api.doc(responses=ENGINE)
def space_map(name: str, query: dict) -> Response:
    """The space's 2-D map: points, and the keys they can be coloured by."""
    from embed.serving.maps import space_map as build_map

    # plain JSON already: the schema's dump would only add time, per point (up to 100,000)
    return jsonify(build_map(db(), zoo_context().settings.data_dir, name, query["color_by"], query["limit"], query["highlight"]))


@api.post("/ingest")
@needs("write")
@api.input(schemas.IngestBody, location="json_or_form", arg_name="body")
@api.output(schemas.Job, status_code=202)
@api.doc(responses=[400, 403, 413, 415])
def ingest(body: dict) -> JobDetail:
    """Queue an ingestion job of paths under the import root, or of uploaded files (`file`); needs a token of scope write."""
    from webapp.jobs import start_ingest

    return start_ingest(body.get("paths") or [], request.files.getlist("file"), body.get("base_model"), current_token().name)


@api.get("/jobs")
@needs("read")
@api.output(schemas.JobList)
@api.doc(responses=READ)
def jobs() -> dict[str, list[JobSummary]]:
    """The newest ingestion jobs with counts per item state, throughput and ETA."""
    from zoo.store.job_resources import list_jobs

    return {"jobs": list_jobs(db())}


@api.get("/jobs/<int:job_id>")
@needs("read")
@api.output(schemas.Job)
@api.doc(responses=READ)
def job(job_id: int) -> JobDetail:
    """An ingestion job: counts per item state, throughput, ETA, mean seconds per stage and the slowest, and its items."""
    from zoo.store.job_resources import get_job

    return get_job(db(), job_id)


#: json_or_form inputs: JSON or a urlencoded form (as their OpenAPI document says), or a multipart form with a `file` upload
JSON_OR_FORM = ("application/json", "application/x-www-form-urlencoded", "multipart/form-data")
#: request bodies each write endpoint reads (anything else is 415)
BODY_TYPES = {
    "api.similar_upload": ("multipart/form-data",),
    "api.predict_attributes": JSON_OR_FORM,
    "api.predict_performance": JSON_OR_FORM,
    "api.ingest": JSON_OR_FORM,
    "api.set_labels": ("application/json",),
}


#: an example of each endpoint's JSON body, for messages that say what to send
JSON_EXAMPLES = {
    "api.predict_attributes": '{"adapter_id": 1} or {"adapter_ids": [1, 2]}',
    "api.predict_performance": '{"adapter_id": 1} or {"adapter_ids": [1, 2]}',
    "api.ingest": '{"paths": ["a/folder/under/the/import/root"]}',
    "api.set_labels": '{"labels": {"task": "qa"}, "measurements": {"accuracy": 0.9}}',
}


def what_to_send(endpoint: str, allowed: Sequence[str]) -> str:
    """The bodies an endpoint reads, in words: its JSON with an example, a multipart form with its `file` part."""
    example = JSON_EXAMPLES.get(endpoint)
    words = {
        "application/json": f"application/json such as {example}" if example else "application/json",
        "multipart/form-data": "multipart/form-data with a `file` part",
    }
    return ", or ".join(words.get(kind, kind) for kind in allowed)


@api.before_request
def _body_type() -> None:
    """A write endpoint's body: of a type it reads (415 otherwise, saying which), JSON that parses (400 saying where)."""
    endpoint = request.endpoint or ""
    allowed = BODY_TYPES.get(endpoint)
    if not allowed:
        return
    send = what_to_send(endpoint, allowed)
    if request.mimetype not in allowed:
        sent = request.mimetype or ("a body of no type" if request.content_length else None)
        raise UnsupportedMediaType(f"send {send}, not {sent}" if sent else f"the request has no body: send {send}")
    if request.is_json:
        refuse_invalid_json(f"a JSON object such as {JSON_EXAMPLES[endpoint]}" if endpoint in JSON_EXAMPLES else "a JSON object")


@api.before_request
def _no_id_beside_an_upload() -> None:
    """POST /similar searches by an upload: an adapter_id beside it (in the query string or the form) is a 422 saying
    where a stored adapter's search is, not an unknown field (or, in the query string, one silently dropped)."""
    if request.endpoint == "api.similar_upload" and ("adapter_id" in request.args or "adapter_id" in request.form):
        stored = "GET /api/v1/adapters/{id}/similar"
        message = f"send adapter_id or file, not both: this searches by an upload in `file`; for a stored adapter, {stored}"
        abort(422, message, detail={"adapter_id": ["sent with file"], "file": ["sent with adapter_id"]})


api.after_app_request(retry_after)


api.before_request(refuse_nul)


@api.before_request
def _refuse_lone_surrogates() -> None:
    """JSON text with a lone surrogate (`"\\ud800"`: JSON allows the escape, UTF-8 cannot encode it, neither database can
    store it) is a 400 naming it, not a 500 from the database driver. Runs after refuse_nul, which parsed the body and
    refused one nested too deep."""
    if not request.is_json:
        return
    try:
        json.dumps(request.get_json(silent=True), ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end].encode("unicode_escape").decode()
        raise UsageError(f"text in a request must be valid Unicode: the JSON body holds a lone surrogate ({bad})") from None
