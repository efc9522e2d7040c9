"""The API's errors say what went wrong and what to send, alike across endpoints: parameters of the upload search in
the query string as on the stored one's, one of adapter_id and an upload, invalid JSON and missing bodies, tokens,
files that are not safetensors, zips that lack a member. Through Flask's test client on the seeded zoo, on SQLite and
PostgreSQL; files are written with the real libraries."""

from __future__ import annotations

import io
import random
import struct
import zipfile
from pathlib import Path

import pytest
from flask.testing import FlaskClient

from tests.conftest import CLI, SeededZoo
from tests.factories import write_kohya_file
from webapp import create_app
from webapp.auth import TOKEN_COOKIE
from zoo.errors import InputError
from zoo.formats.safe_load import load_tensors
from zoo.store import tokens
from zoo.store.session import session_factory

PEFT = ("adapter_config.json", "adapter_model.safetensors")
SIMILAR = "/api/v1/similar"
PREDICT = ("/api/v1/predict/attributes", "/api/v1/predict/performance")


@pytest.fixture(scope="module")
def zoo(seeded: SeededZoo) -> SeededZoo:
    return seeded


@pytest.fixture(scope="module")
def client(zoo: SeededZoo) -> FlaskClient:
    config = {"ZOO_DATABASE_URL": zoo.url, "ZOO_DATA_DIR": str(zoo.data_dir), "ZOO_IMPORT_ROOT": str(zoo.root), "TESTING": True}
    return create_app(config).test_client()


@pytest.fixture(scope="module")
def auth(zoo: SeededZoo) -> dict[str, str]:
    with session_factory(zoo.url).begin() as session:
        _, token = tokens.create_token(session, "errors", "admin")
    return {"Authorization": f"Bearer {token}"}


def error_of(response) -> dict:  # type: ignore[no-untyped-def]
    """The error of a response in the API's one shape."""
    body = response.get_json()
    assert body is not None and set(body) == {"error"}, response.get_data(as_text=True)[:500]
    assert set(body["error"]) == {"status", "type", "message", "detail"} and body["error"]["status"] == response.status_code
    return body["error"]


def peft_upload(path: Path, **fields: str) -> dict:
    """A multipart body: the PEFT directory's two files (each a fresh stream) and form fields."""
    return {"file": [(io.BytesIO((path / n).read_bytes()), n) for n in PEFT], **fields}


def zip_of(path: Path, names: tuple[str, ...]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for n in names:
            zf.write(path / n, f"{path.name}/{n}")
    return buf.getvalue()


def noise(size: int = 4096) -> bytes:
    """Random bytes whose first 8, read as a safetensors header length, claim more than the whole file."""
    data = random.Random(0).randbytes(size)
    assert struct.unpack("<Q", data[:8])[0] > size  # the case at hand: an impossible header length
    return data


# --- the upload search takes its parameters from the query string too ----------------------------------------------


def test_similar_upload_takes_k_and_method_from_the_query_string(client: FlaskClient, zoo: SeededZoo) -> None:
    w03 = zoo.root / "zoo" / "w03"
    r = client.post(f"{SIMILAR}?k=3", data=peft_upload(w03), content_type="multipart/form-data")
    assert r.status_code == 200 and len(r.json["results"]) == 3, r.json
    r = client.post(f"{SIMILAR}?k=2&method=module&filter=task%3Dqv", data=peft_upload(w03), content_type="multipart/form-data")
    assert r.status_code == 200 and r.json["method"] == "module" and len(r.json["results"]) == 2
    assert all(x["labels"]["task"] == "qv" for x in r.json["results"])
    in_form = client.post(SIMILAR, data=peft_upload(w03, k="5", method="sketch"), content_type="multipart/form-data").json
    r = client.post(f"{SIMILAR}?k=5&method=sketch", data=peft_upload(w03), content_type="multipart/form-data")
    assert r.json["results"] == in_form["results"] and len(in_form["results"]) == 5  # the same search, either way
    r = client.post(f"{SIMILAR}?k=3", data=peft_upload(w03, k="3"), content_type="multipart/form-data")  # the same value twice
    assert r.status_code == 200 and len(r.json["results"]) == 3
    e = error_of(client.post(f"{SIMILAR}?k=abc", data=peft_upload(w03), content_type="multipart/form-data"))
    assert e["status"] == 422 and e["type"] == "validation"


def test_similar_upload_refuses_a_parameter_given_twice_with_two_values(client: FlaskClient, zoo: SeededZoo) -> None:
    w03 = zoo.root / "zoo" / "w03"
    e = error_of(client.post(f"{SIMILAR}?k=3", data=peft_upload(w03, k="4"), content_type="multipart/form-data"))
    assert e["status"] == 422 and e["type"] == "validation"
    assert set(e["detail"]) == {"k"} and "query string" in e["message"] and "form" in e["message"], e
    e = error_of(client.post(f"{SIMILAR}?method=module", data=peft_upload(w03, method="sketch"), content_type="multipart/form-data"))
    assert e["status"] == 422 and set(e["detail"]) == {"method"}


def test_the_openapi_document_lists_the_upload_search_query_parameters(client: FlaskClient) -> None:
    operation = client.get("/api/v1/openapi.json").json["paths"][SIMILAR]["post"]
    in_query = {p["name"] for p in operation.get("parameters", []) if p["in"] == "query"}
    assert {"k", "space", "method", "filter"} <= in_query
    assert "422" in operation["responses"]


# --- one of adapter_id and an upload -------------------------------------------------------------------------------


@pytest.mark.parametrize("url", PREDICT)
def test_predict_refuses_an_id_and_an_upload_together(client: FlaskClient, zoo: SeededZoo, url: str) -> None:
    new = zoo.root / "outside" / "new"
    for field, value in (("adapter_id", "1"), ("adapter_ids", "2")):
        e = error_of(client.post(url, data=peft_upload(new, **{field: value}), content_type="multipart/form-data"))
        assert e["status"] == 422 and e["type"] == "validation", e
        assert field in e["message"] and "file" in e["message"] and "one" in e["message"], e
    e = error_of(client.post(url, json={"adapter_id": 1, "adapter_ids": [2, 3]}))
    assert e["status"] == 422 and "adapter_id" in e["message"] and "adapter_ids" in e["message"]
    assert client.post(url, data=peft_upload(new), content_type="multipart/form-data").status_code == 200  # either alone is read
    assert client.post(url, json={"adapter_id": 1}).status_code == 200


def test_similar_upload_refuses_an_adapter_id_beside_the_file(client: FlaskClient, zoo: SeededZoo) -> None:
    e = error_of(client.post(SIMILAR, data=peft_upload(zoo.root / "zoo" / "w03", adapter_id="1"), content_type="multipart/form-data"))
    assert e["status"] == 422 and e["type"] == "validation"
    assert "adapter_id" in e["message"] and "file" in e["message"] and "/api/v1/adapters/{id}/similar" in e["message"], e
    r = client.post(f"{SIMILAR}?adapter_id=1", data=peft_upload(zoo.root / "zoo" / "w03"), content_type="multipart/form-data")
    assert error_of(r)["type"] == "validation"  # in the query string too: never silently dropped


# --- bodies: invalid JSON, none at all ------------------------------------------------------------------------------


def test_invalid_json_says_where_and_what_to_send(client: FlaskClient, auth: dict[str, str]) -> None:
    calls = [
        ("POST", PREDICT[0], '{"adapter_id": 1,}', "adapter_id"),
        ("POST", PREDICT[1], "{adapter_id: 1}", "adapter_id"),
        ("POST", "/api/v1/ingest", '{"paths": ["a"]\n "b"}', "paths"),
        ("PUT", "/api/v1/adapters/1/labels", '{"labels": {"task": "qk"', "labels"),
    ]
    for method, url, body, field in calls:
        e = error_of(client.open(url, method=method, data=body, content_type="application/json", headers=auth))
        assert e["status"] == 400 and e["type"] == "bad_request", e
        assert "not valid JSON" in e["message"] and "line " in e["message"] and "column " in e["message"], e
        assert field in e["message"] and "browser (or proxy)" not in e["message"], e
    e = error_of(client.post(PREDICT[0], data=b'{"adapter_id": "\xff"}', content_type="application/json"))
    assert e["status"] == 400 and "not valid JSON" in e["message"]


def test_a_missing_body_says_what_to_send(client: FlaskClient, auth: dict[str, str]) -> None:
    e = error_of(client.post(SIMILAR))
    assert e["status"] == 415 and e["type"] == "unsupported_media_type"
    assert "no body" in e["message"] and "multipart/form-data with a `file` part" in e["message"] and "not no body" not in e["message"]
    for url in (*PREDICT, "/api/v1/ingest"):
        e = error_of(client.post(url, headers=auth))
        assert e["status"] == 415 and "the request has no body: send application/json" in e["message"], e
    e = error_of(client.post(SIMILAR, data="x", content_type="text/plain"))
    assert e["status"] == 415 and "not text/plain" in e["message"]  # a wrong type is still named


# --- tokens ---------------------------------------------------------------------------------------------------------


def test_a_401_says_how_to_send_a_token_and_whether_it_was_known(client: FlaskClient, zoo: SeededZoo, auth: dict[str, str]) -> None:
    for headers in ({}, {"Authorization": "Token abc"}):
        r = client.post("/api/v1/ingest", json={"paths": ["zoo/w01"]}, headers=headers)
        e = error_of(r)
        assert e["type"] == "unauthorized" and r.headers["WWW-Authenticate"].startswith("Bearer")
        assert "Authorization: Bearer <token>" in e["message"] and "zoo token create NAME" in e["message"], e
        assert "unknown or revoked" not in e["message"]
    for r in (
        client.delete("/api/v1/adapters/1", headers={"Authorization": "Bearer zoo_wrong"}),
        client.put("/api/v1/adapters/1/labels", json={"labels": {"a": "b"}}, headers={"Authorization": "Bearer zoo_wrong"}),
    ):
        e = error_of(r)
        assert e["status"] == 401 and "unknown or revoked" in e["message"] and "zoo token create NAME" in e["message"], e
    signed_in = client.application.test_client()
    signed_in.set_cookie(TOKEN_COOKIE, auth["Authorization"].removeprefix("Bearer "))
    e = error_of(signed_in.delete("/api/v1/adapters/1"))  # an admin token, in a cookie that reads only
    assert e["status"] == 403 and "the sign-in cookie only reads" in e["message"], e
    closed = create_app({"ZOO_DATABASE_URL": zoo.url, "ZOO_DATA_DIR": str(zoo.data_dir), "ZOO_READ_TOKEN_REQUIRED": "1"}).test_client()
    e = error_of(closed.get("/api/v1/adapters/1", headers={"Authorization": "Bearer zoo_wrong"}))
    assert "unknown or revoked" in e["message"] and "Authorization: Bearer <token>" in e["message"]


# --- files that are not safetensors, zips that lack a member ------------------------------------------------------


def test_random_bytes_are_not_a_safetensors_file(client: FlaskClient) -> None:
    e = error_of(client.post(SIMILAR, data={"file": [(io.BytesIO(noise()), "noise.safetensors")]}, content_type="multipart/form-data"))
    assert e["status"] == 422 and e["type"] == "unprocessable"
    assert e["message"].startswith("noise.safetensors: not a safetensors file") and "exceeds the limit" not in e["message"], e
    for head in (struct.pack("<Q", 16) + b"\x00" * 24, struct.pack("<Q", 0) + b"{}"):  # a header that cannot be JSON, none
        r = client.post(SIMILAR, data={"file": [(io.BytesIO(head), "zeros.safetensors")]}, content_type="multipart/form-data")
        assert error_of(r)["message"].startswith("zeros.safetensors: not a safetensors file"), error_of(r)


def test_ingest_names_a_file_of_random_bytes_and_why(cli: CLI, tmp_path: Path) -> None:
    path = tmp_path / "noise.safetensors"
    path.write_bytes(noise())
    rc, (result,) = cli.json_lines("ingest", "--no-embed", str(path), "--base-model", "tiny")
    assert rc == 1 and result["status"] == "failed"
    error = result["error"]
    assert error.startswith(f"{path}: not a safetensors file") and "header length of" in error and "more than its 4096 bytes" in error


def test_a_plausible_header_past_the_limit_keeps_the_limit_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "k.safetensors"
    write_kohya_file(path)
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    monkeypatch.setenv("ZOO_MAX_HEADER_BYTES", str(n - 1))
    with pytest.raises(InputError, match=f"safetensors header of {n} bytes exceeds the limit of {n - 1} bytes") as exc:
        load_tensors(path)
    assert "not a safetensors file" not in str(exc.value)


@pytest.mark.parametrize(
    ("names", "missing"),
    [
        (("adapter_config.json",), "adapter_model.safetensors is missing"),
        (("adapter_model.safetensors",), "adapter_config.json is missing"),
    ],
)
def test_an_upload_lacking_a_peft_file_names_it(client: FlaskClient, zoo: SeededZoo, names: tuple[str, ...], missing: str) -> None:
    w03 = zoo.root / "zoo" / "w03"
    zipped = {"file": [(io.BytesIO(zip_of(w03, names)), "half.zip")]}
    e = error_of(client.post(SIMILAR, data=zipped, content_type="multipart/form-data"))
    assert e["status"] == 422 and e["message"].startswith(f"half.zip: {missing}"), e
    if names == ("adapter_config.json",):  # a lone adapter_model.safetensors is read as a LoRA file
        loose = {"file": [(io.BytesIO((w03 / n).read_bytes()), n) for n in names]}
        e = error_of(client.post(SIMILAR, data=loose, content_type="multipart/form-data"))
        assert e["status"] == 422 and missing in e["message"] and "not an adapter upload" not in e["message"], e


def test_load_tensors_of_random_bytes_says_so(tmp_path: Path) -> None:
    path = tmp_path / "n.safetensors"
    path.write_bytes(noise())
    with pytest.raises(InputError, match="not a safetensors file") as exc:
        load_tensors(path)
    assert str(path) in str(exc.value) and "header length" in str(exc.value)
