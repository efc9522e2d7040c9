"""The pages people use. Each renders the same resource dict as its JSON twin under /api/v1."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from apiflask import APIBlueprint
from flask import redirect, render_template, request, url_for
from werkzeug.wrappers import Response

from embed.serving import adapter_resource, resources, spaces_resource
from embed.serving.refs import UploadedFile
from webapp.auth import needs
from webapp.context import db, zoo_context
from webapp.shared import get_adapter, ids_in_range, limited_upload, refuse_nul, space_filters
from zoo.errors import NotReadyError, ZooError
from zoo.labels import TASK_KEY
from zoo.limits import DEFAULT_K, DEFAULT_PER_PAGE, MAX_PAGE, MAX_PAGE_K
from zoo.store import repository
from zoo.store.catalog import FACET_VALUES, FacetValue
from zoo.store.filters import facet_filter_name

if TYPE_CHECKING:
    from zoo.store.session import Session

ui = APIBlueprint("ui", __name__, enable_openapi=False)
ui.url_value_preprocessor(ids_in_range)
ui.before_request(refuse_nul)


@ui.context_processor
def _limits() -> dict[str, int]:
    """The similar page's k, as its form offers it."""
    return {"DEFAULT_K": DEFAULT_K, "MAX_PAGE_K": MAX_PAGE_K}


def _filters_from_args() -> list[str]:
    return [f for f in request.args.getlist("filter") if f]


@ui.get("/")
@needs("read")
def search_page() -> str:
    from embed.serving.text_search import search_by_meaning
    from zoo.store.catalog import search_catalog

    filters = _filters_from_args()
    space = request.args.get("space") or None
    page = min(max(1, request.args.get("page", 1, type=int) or 1), MAX_PAGE)  # an offset the database can hold
    sort = request.args.get("sort") or None  # the page keeps this, not found["sort"]: a resolved default would stick to later searches
    chosen = space_filters(db(), space, repository.parse_filters(filters))
    semantic = request.args.get("semantic", "1") != "0"  # by meaning unless asked for exact words
    q, notice = request.args.get("q") or None, None
    try:
        found = search_by_meaning(db(), zoo_context().engine, q, chosen, sort, page, DEFAULT_PER_PAGE) if semantic else None
    except NotReadyError as exc:  # no sentence encoder here: the words alone
        found, notice = None, str(exc)
    if found is None:
        found = search_catalog(db(), q, chosen, sort, page, DEFAULT_PER_PAGE)
    args: dict[str, Any] = {**request.args.to_dict(flat=False), "semantic": "1" if semantic else "0"}
    twin = url_for("api.adapters", **args)
    major, minor = facet_groups({k: v for k, v in found["facets"].items() if not (space and k == "base_model")})  # the space names it
    spaces = space_choices(spaces_resource.space_names(db()), found["facets"].get("base_model", []))
    names = {key: facet_filter_name(key) for key in found["facets"]}  # what a facet's values are chosen by: `label.rank` a label's
    return render_template(
        "search.html",
        found=found,
        filters=filters,
        sort=sort,
        twin=twin,
        major=major,
        minor=minor,
        names=names,
        space=space,
        spaces=spaces,
        semantic=semantic,
        notice=notice,
    )


def space_choices(spaces: Sequence[spaces_resource.SpaceName], base_models: Sequence[FacetValue]) -> list[dict]:
    """The spaces to pick from, each with how many adapters of the search are in it (from the base_model facet, which
    counts them whichever space is picked; None past the facet's values)."""
    counts = {v["value"]: v["count"] for v in base_models}
    return [{"name": s["name"], "count": counts.get(s["base_model"], None if len(counts) >= FACET_VALUES else 0)} for s in spaces]


def facet_groups(facets: Mapping[str, Sequence[FacetValue]]) -> tuple[list[str], list[str]]:
    """The facets worth filtering by, the task first, and the others (a single value, or one that most adapters
    share with no other: seeds, learning rates), shown folded. Empty facets are in neither."""

    def minor(values: Sequence[FacetValue]) -> bool:
        return len(values) < 2 or 2 * sum(v["count"] == 1 for v in values) > sum(v["count"] for v in values)

    keys = sorted((k for k, v in facets.items() if v), key=lambda k: k != f"label:{TASK_KEY}")  # stable otherwise
    return [k for k in keys if not minor(facets[k])], [k for k in keys if minor(facets[k])]


@ui.get("/api/v1/docs")
def api_docs_page() -> str:
    """Swagger UI over the OpenAPI document, inside the site's own page."""
    return render_template("api_docs.html", spec=url_for("openapi.spec"))


@ui.get("/adapters/<int:adapter_id>")
@needs("read")
def adapter_page(adapter_id: int) -> str:
    from zoo.services.export import exportable_formats, load_meta

    resource = adapter_resource.adapter_resource(zoo_context().engine, db(), get_adapter(adapter_id, with_modules=True))
    twin = url_for("api.adapter", adapter_id=adapter_id)
    downloads = exportable_formats(load_meta(db(), zoo_context().blobs, adapter_id, with_head=False))  # those an export writes
    return render_template("adapter.html", a=resource, twin=twin, downloads=downloads)


@ui.get("/map")
@needs("read")
def map_page() -> str:
    spaces = spaces_resource.list_spaces(db())
    name = request.args.get("space") or (spaces[0]["name"] if spaces else None)
    color_by, highlight = request.args.get("color_by"), request.args.get("highlight") or ""
    twin = url_for("api.space_map", name=name, color_by=color_by or None, highlight=highlight or None) if name else None
    return render_template("map.html", spaces=spaces, space=name, color_by=color_by, highlight=highlight, twin=twin)


@ui.route("/similar", methods=["GET", "POST"])
@needs("read")
def similar_page() -> tuple[str, int] | str:
    spaces = spaces_resource.list_spaces(db())
    if request.method == "GET":
        return render_template("similar.html", result=None, error=None, spaces=spaces, space=request.args.get("space") or "")
    engine = zoo_context().engine
    k = min(max(request.form.get("k", DEFAULT_K, type=int) or DEFAULT_K, 1), MAX_PAGE_K)
    space = request.form.get("space") or None  # None: the space of the adapter's own base model
    try:

        def run(session: Session, upload: UploadedFile) -> tuple[resources.SearchResource, resources.PredictionResource | dict[str, str]]:
            found = resources.search(engine, session, upload, k, space)
            predicted: resources.PredictionResource | dict[str, str]
            try:
                predicted = resources.predict(engine, session, upload, str(found["space"]))
            except ZooError as exc:
                predicted = {"error": str(exc)}
            return found, predicted

        found, predicted = limited_upload(request.files.getlist("file"), run)
    except ZooError as exc:
        return render_template("similar.html", result=None, error=str(exc), spaces=spaces, space=space or ""), exc.http_status
    return render_template("similar.html", result=found, predicted=predicted, error=None, spaces=spaces, space=space or "")


@ui.get("/jobs")
@needs("read")
def jobs_page() -> str:
    from zoo.store.job_resources import list_jobs

    return render_template("jobs.html", jobs=list_jobs(db()), twin=url_for("api.jobs"))


@ui.get("/jobs/<int:job_id>")
@needs("read")
def job_page(job_id: int) -> str:
    from zoo.store.job_resources import get_job

    return render_template("job.html", j=get_job(db(), job_id), twin=url_for("api.job", job_id=job_id))


@ui.route("/sign-in", methods=["GET", "POST"])
def sign_in() -> tuple[str, int] | Response:
    """Where a browser gives its token when reads need one (ZOO_READ_TOKEN_REQUIRED): kept in an HttpOnly cookie that
    reads accept like the Authorization header (webapp/auth.py). The cookie reads only, unless the form's `writes` box
    is ticked: then it may do what the token may (the docs page's "Try it out" writes with it)."""
    from webapp.auth import TOKEN_COOKIE, cookie_value, live_token
    from webapp.security import local_path

    back = local_path(request.values.get("next"))
    if request.method != "POST":
        return render_template("sign_in.html", problem=None, next=back), 200
    token = (request.form.get("token") or "").strip()
    if not token:
        return render_template("sign_in.html", problem="paste a token first", next=back), 400
    found = live_token(token)
    if found is None:
        problem = "that token is unknown or revoked (mistyped?): `zoo token create NAME` makes one"
        return render_template("sign_in.html", problem=problem, next=back), 401
    scope = found.scope if request.form.get("writes") else "read"
    response = redirect(back, code=303)
    response.set_cookie(TOKEN_COOKIE, cookie_value(token, scope), httponly=True, samesite="Lax", secure=request.is_secure)
    return response


@ui.post("/sign-out")
def sign_out() -> Response:
    from webapp.auth import TOKEN_COOKIE

    response = redirect(url_for("ui.sign_in"), code=303)
    response.delete_cookie(TOKEN_COOKIE, httponly=True, samesite="Lax", secure=request.is_secure)
    return response
