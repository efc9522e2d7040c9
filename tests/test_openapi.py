"""The REST API against its own OpenAPI document (schemathesis, through WSGI) on a small real zoo, on SQLite and
PostgreSQL: every operation, with valid and invalid inputs, answers without a 5xx, with a documented status,
content type and headers, and a body that matches the documented schema."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import SeededZoo
from tests.factories import SEEDED
from webapp import create_app
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
        _, token = tokens.create_token(session, "schemathesis")
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
        ("GET", "/api/v1/adapters/2147483648", None, 404),
        ("GET", "/adapters/9223372036854775808", None, 404),
        ("GET", "/api/v1/jobs/9223372036854775808", None, 404),
        ("POST", "/api/v1/predict/performance", {"adapter_ids": [2**63]}, 422),
        ("GET", "/api/v1/spaces/tiny/map?highlight=9223372036854775808", None, 422),
        ("GET", "/?page=99999999999999999999", None, 200),  # clamped to the last page searched (empty)
    ],
)
def test_what_a_database_cannot_hold_never_reaches_it(api: Api, method: str, url: str, body: dict | None, status: int) -> None:
    """NUL characters (PostgreSQL cannot store them), ids past an SQL INTEGER, offsets past a 64-bit one: the same
    answer on both databases, never a 500 from the driver."""
    r = api.schema.app.test_client().open(url, method=method, json=body, headers=api.auth)
    assert r.status_code == status, (url, r.status_code)
