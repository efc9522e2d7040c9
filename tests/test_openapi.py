"""The REST API against its own OpenAPI document (schemathesis, through WSGI) on a small real zoo, on SQLite and
PostgreSQL: every operation, with valid and invalid inputs, answers without a 5xx, with a documented status,
content type and headers, and a body that matches the documented schema."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NotRequired, get_args, get_origin, get_type_hints

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from embed.serving.adapter_resource import AdapterResource
from embed.serving.maps import MapResource
from embed.serving.resources import PredictionResource, SearchResource
from embed.serving.spaces_resource import EmbedderEntry, SpacesResource
from tests.conftest import SeededZoo
from tests.factories import SEEDED
from webapp import create_app
from webapp import schemas as webapp_schemas
from zoo.store import tokens
from zoo.store.session import session_factory

ADAPTERS = SEEDED  # the seeded zoo's; its space is "tiny"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance, response_schema_conformance]


@dataclass
class Api:
    schema: schemathesis.BaseSchema
    auth: dict[str, str]


@pytest.fixture(scope="module")
def api(seeded: SeededZoo) -> Iterator[Api]:
    """The app on the module's copy of the seeded zoo (its import root is the seed's directory), its schema, and a
    token for the writes, on each backend."""
    with session_factory(seeded.url).begin() as session:
        _, token = tokens.create_token(session, "schemathesis", "admin")
    config = {"ZOO_DATABASE_URL": seeded.url, "ZOO_DATA_DIR": str(seeded.data_dir), "ZOO_IMPORT_ROOT": str(seeded.root), "TESTING": True}
    app = create_app(config)
    schema = schemathesis.openapi.from_wsgi("/api/v1/openapi.json", app)
    schema.hook("map_path_parameters")(_mostly_existing)
    yield Api(schema, {"Authorization": f"Bearer {token}"})
    app.extensions["zoo"].jobs.shutdown(wait=True)  # the ingest jobs it started write nothing after this module


def _mostly_existing(_ctx: schemathesis.HookContext, path: dict[str, Any] | None) -> dict[str, Any] | None:
    """Small generated ids folded onto what the zoo holds (adapters 1..12 and one past each end, the first jobs) and
    half the space names onto "tiny", so that 200 responses are checked too, not only 404s."""
    if not path:
        return path
    path = dict(path)
    for key, count in (("adapter_id", ADAPTERS + 2), ("job_id", 4)):
        if isinstance(path.get(key), int) and 0 <= path[key] < 1000:
            path[key] %= count
    if isinstance(path.get("name"), str) and len(path["name"]) % 2 == 0:
        path["name"] = "tiny"
    return path


@pytest.fixture(scope="module")
def api_schema(api: Api) -> schemathesis.BaseSchema:
    return api.schema


schema = schemathesis.pytest.from_fixture("api_schema")


def test_schemas_follow_the_resource_types() -> None:
    """A derived schema declares its TypedDict's keys, each required unless NotRequired and nullable where None is
    allowed; the predict endpoints' and the map's declare the keys those endpoints keep."""
    cases = [
        (webapp_schemas.SearchOut, SearchResource),
        (webapp_schemas.AdapterOut, AdapterResource),
        (webapp_schemas.SpacesOut, SpacesResource),
        (webapp_schemas.typed_schema(EmbedderEntry), EmbedderEntry),
        (webapp_schemas.MapOut, MapResource),
    ]
    for derived, resource in cases:
        fields = derived().fields
        assert set(fields) == set(resource.__annotations__) - {"file"}, derived
        for key, hint in get_type_hints(resource, include_extras=True).items():
            if key in fields:
                required = get_origin(hint) is not NotRequired
                assert fields[key].required == required, (resource, key)
                assert fields[key].allow_none == (type(None) in get_args(hint if required else get_args(hint)[0])), (resource, key)
    for part, derived in (("attributes", webapp_schemas.AttributesOut), ("metrics", webapp_schemas.PerformanceOut)):
        one = derived().fields["predictions"].inner.schema
        assert tuple(one.fields) == webapp_schemas.PREDICTION_KEYS[part]
        assert set(one.fields) <= set(PredictionResource.__annotations__)


#: operations whose 2xx body is not JSON
NOT_JSON = {("GET", "/api/v1/adapters/{adapter_id}/download")}


def _spec(api: Api) -> dict[str, Any]:
    return api.schema.app.test_client().get("/api/v1/openapi.json").get_json()


def test_every_json_operation_documents_its_response_schema(api: Api) -> None:
    """Every route of the API is in the document, and each that answers JSON documents the schema of its 2xx body."""
    app, spec = api.schema.app, _spec(api)
    routes = {
        (method, re.sub(r"<(?:[^:>]+:)?([^>]+)>", r"{\1}", rule.rule))
        for rule in app.url_map.iter_rules()
        if rule.endpoint.startswith("api.")
        for method in (rule.methods or set()) & {"GET", "POST", "PUT", "DELETE"}
    }
    assert routes == {(m.upper(), path) for path, ops in spec["paths"].items() for m in ops}
    for method, path in routes - NOT_JSON:
        ok = {code: r for code, r in spec["paths"][path][method.lower()]["responses"].items() if code.startswith("2")}
        assert ok, (method, path)
        for code, response in ok.items():
            assert "$ref" in response.get("content", {}).get("application/json", {}).get("schema", {}), (method, path, code)


def test_the_document_names_each_write_scope_and_no_client_host(api: Api) -> None:
    """The routes that need a token list the bearer scheme with the scope they declare (as its role) and their 403; the
    document's server is relative, whatever Host asked first (apiflask built it from the first request's Host, kept)."""
    from webapp.auth import declared_scope

    app = api.schema.app
    first = app.test_client().get("/api/v1/openapi.json", headers={"Host": "evil.example"}).get_json()
    spec = _spec(api)
    assert first["servers"] == spec["servers"] == [{"url": "/"}]
    for rule in app.url_map.iter_rules():
        if not rule.endpoint.startswith("api."):
            continue  # pages and files: not in the API's document
        scope = declared_scope(app, rule.endpoint)
        path = re.sub(r"<(?:[^:>]+:)?([^>]+)>", r"{\1}", rule.rule)
        for method in (rule.methods or set()) & {"GET", "POST", "PUT", "DELETE"}:
            operation = spec["paths"][path][method.lower()]
            if scope in ("write", "admin"):
                assert operation["security"] == [{"BearerAuth": [scope]}] and "403" in operation["responses"], (method, path)
            else:
                assert "security" not in operation, (method, path)


def test_each_resource_has_the_keys_its_schema_declares(api: Api) -> None:
    """Every JSON resource of a seeded adapter (and of the zoo) conforms to its documented schema, with every key
    the schema declares (those it marks optional aside) and no other, at every level."""
    spec, client = _spec(api), api.schema.app.test_client()
    ids = [r["id"] for r in client.get("/api/v1/adapters?sort=name", headers=api.auth).json["results"]]  # those still stored
    first, last = ids[0], ids[-1]
    calls = [
        ("GET", "/api/v1/health", None),
        ("GET", "/api/v1/adapters?q=w0&filter=task%3Dqk", None),
        ("GET", f"/api/v1/adapters/{first}", None),
        ("GET", f"/api/v1/adapters/{first}/lineage", None),
        ("GET", f"/api/v1/adapters/{first}/similar?k=5", None),
        ("POST", "/api/v1/predict/attributes", {"adapter_ids": [first, last]}),
        ("POST", "/api/v1/predict/performance", {"adapter_id": first}),
        ("PUT", f"/api/v1/adapters/{first}/labels", {"labels": {"style": "x"}, "measurements": {"f1": 0.5}}),
        ("GET", "/api/v1/spaces", None),
        ("GET", "/api/v1/spaces/tiny/map?color_by=task", None),
        ("GET", "/api/v1/jobs", None),
        ("DELETE", f"/api/v1/adapters/{last}", None),
    ]
    for method, url, body in calls:
        r = client.open(url, method=method, json=body, headers=api.auth)
        assert r.status_code == 200, (url, r.json)
        path = _template(spec, url.split("?")[0])
        api.schema[path][method].validate_response(r)
        ok = spec["paths"][path][method.lower()]["responses"]["200"]
        _assert_declared_keys(spec, ok["content"]["application/json"]["schema"], r.json, f"{method} {url}")


def _template(spec: dict[str, Any], path: str) -> str:
    """The document's path that a concrete path is of."""
    for template in spec["paths"]:
        if re.fullmatch(re.sub(r"\\{[^}]+\\}", "[^/]+", re.escape(template)), path):
            return template
    raise AssertionError(f"{path} is not in the document")


def _assert_declared_keys(spec: dict[str, Any], schema: dict[str, Any], body: Any, where: str) -> None:
    if "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    if body is None:
        return
    if "anyOf" in schema:  # a nullable nested object
        (schema,) = [s for s in schema["anyOf"] if s.get("type") != "null"]
        _assert_declared_keys(spec, schema, body, where)
    elif isinstance(body, list):
        for i, item in enumerate(body):
            _assert_declared_keys(spec, schema.get("items", {}), item, f"{where}[{i}]")
    elif isinstance(body, dict) and "properties" in schema:
        declared = set(schema["properties"])
        optional = declared - set(schema.get("required", declared))
        assert declared - optional <= set(body) <= declared, (where, sorted(set(body) ^ declared))
        for key, value in body.items():
            _assert_declared_keys(spec, schema["properties"][key], value, f"{where}.{key}")
    elif isinstance(body, dict) and isinstance(schema.get("additionalProperties"), dict):  # keys by name: labels, attributes
        for key, value in body.items():
            _assert_declared_keys(spec, schema["additionalProperties"], value, f"{where}.{key}")


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=10, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_every_operation_conforms(case: schemathesis.Case, api: Api) -> None:
    case.call_and_validate(headers=api.auth, checks=CHECKS)


@pytest.mark.parametrize(
    ("method", "url", "body", "status"),
    [
        ("GET", "/api/v1/adapters?filter=task%3D%00", None, 400),
        ("GET", "/api/v1/spaces/%00/map", None, 400),
        ("GET", "/?q=a%00", None, 400),
        ("PUT", "/api/v1/adapters/1/labels", {"labels": {"style": "a\x00"}}, 400),
        ("POST", "/api/v1/predict/attributes", {"adapter_id": 1, "space": "\x00"}, 400),
        ("PUT", "/api/v1/adapters/1/labels", {"labels": {"style": "\ud800"}}, 400),  # a lone surrogate: UTF-8 cannot hold it
        ("PUT", "/api/v1/adapters/1/labels", {"measurements": {"\udfff": 0.5}}, 400),
        ("POST", "/api/v1/ingest", {"paths": ["zoo/\ud83d"]}, 400),
        ("GET", "/api/v1/adapters/2147483648", None, 404),
        ("GET", "/adapters/9223372036854775808", None, 404),
        ("GET", "/api/v1/jobs/9223372036854775808", None, 404),
        ("POST", "/api/v1/predict/performance", {"adapter_ids": [2**63]}, 422),
        ("GET", "/api/v1/spaces/tiny/map?highlight=9223372036854775808", None, 422),
        ("GET", "/?page=99999999999999999999", None, 200),  # clamped to the last page searched (empty)
    ],
)
def test_what_a_database_cannot_hold_never_reaches_it(api: Api, method: str, url: str, body: dict | None, status: int) -> None:
    """NUL characters (PostgreSQL cannot store them), lone surrogates (neither can, nor UTF-8), ids past an SQL INTEGER,
    offsets past a 64-bit one: the same answer on both databases, never a 500 from the driver."""
    r = api.schema.app.test_client().open(url, method=method, json=body, headers=api.auth)
    assert r.status_code == status, (url, r.status_code)


def _json_text(names: list[str]) -> st.SearchStrategy[str]:
    """JSON text a client may send, hostile where a parser or a database is weakest: integers of up to 6,000 digits
    (Python refuses to convert past 4,300), numbers past a double, any code point including lone surrogates (JSON's
    \\u escapes can write them, UTF-8 cannot hold them), NUL; keys drawn mostly from the operation's own properties so
    the values reach the code behind the parser."""
    huge = st.sampled_from([20, 400, 4301, 6000]).map(lambda n: "9" * n)
    numbers = st.one_of(st.integers().map(str), huge, st.sampled_from(["1e400", "-1e400", "1.5", "-0", "0.1e-400"]))
    strings = st.text(st.characters(codec=None, categories=None), max_size=12).map(json.dumps)
    scalars = st.one_of(numbers, strings, st.sampled_from(["true", "false", "null"]))
    keys = st.one_of(st.sampled_from(names), st.text(st.characters(codec=None), max_size=6)) if names else st.text(max_size=6)

    def nest(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        arrays = st.lists(inner, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]")
        objects = st.dictionaries(keys, inner, max_size=4).map(lambda d: "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in d.items()) + "}")
        return st.one_of(arrays, objects)

    return st.recursive(scalars, nest, max_leaves=12)


def _json_operations(api: Api) -> list[tuple[str, str, list[str]]]:
    """(method, path with the first adapter's and job's ids and the space "tiny", the body's top-level property names)
    of every operation that takes a JSON body."""
    spec = api.schema.app.test_client().get("/api/v1/openapi.json").get_json()
    found = []
    for path, item in spec["paths"].items():
        for method, op in item.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            if body is None:
                continue
            ref = body["schema"].get("$ref", "")
            props = spec["components"]["schemas"].get(ref.rsplit("/", 1)[-1], body["schema"]).get("properties", {})
            url = re.sub(r"\{(\w+)\}", lambda m: {"name": "tiny"}.get(m.group(1), "1"), path)
            found.append((method.upper(), url, sorted(props)))
    return found


def test_hostile_json_bodies_never_answer_5xx(api: Api) -> None:
    """Every operation with a JSON body, sent JSON text with giant integers, overflowing numbers, lone surrogates and
    NUL at any depth: a 4xx or a 2xx, never a 5xx, on both databases."""
    operations = _json_operations(api)
    assert len(operations) >= 4, operations
    client = api.schema.app.test_client()
    headers = {**api.auth, "Content-Type": "application/json"}
    for method, url, names in operations:
        _never_5xx(client, headers, method, url, names)()


def _never_5xx(client: Any, headers: dict[str, str], method: str, url: str, names: list[str]) -> Any:
    """A hypothesis test sending one operation hostile JSON bodies."""

    @given(text=_json_text(names))
    @settings(max_examples=15, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    def sends(text: str) -> None:
        r = client.open(url, method=method, data=text.encode("utf-8", "surrogatepass"), headers=headers)
        assert r.status_code < 500, (method, url, text[:200], r.status_code, r.get_data(as_text=True)[:300])

    return sends
