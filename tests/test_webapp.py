"""The web app and REST API through Flask's test client, on SQLite and PostgreSQL, on a small real zoo
(real PEFT adapters, ingested, embedded and with W2T trained)."""

from __future__ import annotations

import io
import json
import re
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from flask.testing import FlaskClient

from tests.conftest import SeededZoo
from tests.factories import SEEDED, write_kohya_file
from webapp import create_app
from zoo.cli import main

N = SEEDED


@dataclass
class Web:
    client: FlaskClient
    url: str
    data_dir: Path
    adapters: Path

    def zoo(self, *args: str) -> int:
        return main(["--db", self.url, "--data-dir", str(self.data_dir), *args])


@pytest.fixture(scope="module")
def web(seeded: SeededZoo) -> Web:
    """The app on the module's copy of the seeded zoo (tests/conftest.py: adapters w00..w11, tasks qk/qv, and
    outside/new), on each backend."""
    app = create_app(
        {"ZOO_DATABASE_URL": seeded.url, "ZOO_DATA_DIR": str(seeded.data_dir), "ZOO_IMPORT_ROOT": str(seeded.root), "TESTING": True}
    )
    return Web(app.test_client(), seeded.url, seeded.data_dir, seeded.root)


def error_of(response) -> dict:  # type: ignore[no-untyped-def]
    body = response.get_json()
    assert set(body) == {"error"} and set(body["error"]) == {"status", "type", "message", "detail"}
    assert body["error"]["status"] == response.status_code
    return body["error"]


def peft_files(path: Path) -> dict:
    return {"file": [(io.BytesIO((path / n).read_bytes()), n) for n in ("adapter_config.json", "adapter_model.safetensors")]}


def zipped(path: Path) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for n in ("adapter_config.json", "adapter_model.safetensors"):
            zf.write(path / n, f"{path.name}/{n}")
    return buf.getvalue()


def test_health_and_openapi(web: Web) -> None:
    r = web.client.get("/api/v1/health")
    assert r.status_code == 200 and r.json["adapters"] == N and r.json["status"] == "ok"
    spec = web.client.get("/api/v1/openapi.json").json
    assert spec["openapi"].startswith("3.")
    for path in (
        "/api/v1/adapters",
        "/api/v1/adapters/{adapter_id}",
        "/api/v1/adapters/{adapter_id}/similar",
        "/api/v1/similar",
        "/api/v1/predict/attributes",
        "/api/v1/predict/performance",
        "/api/v1/adapters/{adapter_id}/download",
        "/api/v1/spaces",
        "/api/v1/spaces/{name}/map",
        "/api/v1/ingest",
        "/api/v1/jobs/{job_id}",
        "/api/v1/health",
    ):
        assert path in spec["paths"], path
    assert "BearerAuth" in json.dumps(spec["components"])
    docs = web.client.get("/api/v1/docs").get_data(as_text=True)
    assert "/static/vendor/swagger-ui/swagger-ui-bundle.js" in docs and "cdn." not in docs and "https://" not in docs.split("<body")[0]


def test_adapter_detail_and_not_found(web: Web) -> None:
    r = web.client.get("/api/v1/adapters/1")
    assert r.status_code == 200
    a = r.json
    assert a["id"] == 1 and a["labels"]["task"] in ("qk", "qv") and a["modules"] and a["canonical_hash"]
    assert [x["adapter_id"] for x in a["neighbours"]["results"]] and 1 not in [x["adapter_id"] for x in a["neighbours"]["results"]]
    assert a["predictions"]["attributes"]["task"] and a["predictions"]["embedder_id"]
    # the page names the five best candidates of each choice by their out-of-fold score and how many there were
    page = web.client.get("/adapters/1").get_data(as_text=True)
    choices = [c["scores"] for c in a["predictions"]["choices"].values() if len(c["scores"]) > 5]
    assert choices
    for scores in choices:
        top = max(scores.values())
        tied = [name for name, v in scores.items() if v == top]  # the JSON sorts keys: ties may come in another order
        assert any(f"best out of fold: {name}: {top:.3f}" in page for name in tied)
        assert f"; {len(scores)} candidates, every score in the JSON" in page
    for key, c in a["predictions"]["choices"].items():  # each choice named once: its reason starts with the name
        assert f"<strong>{key}</strong>: {c['chosen']}: {c['chosen']}" not in page
    e = error_of(web.client.get("/api/v1/adapters/9999"))
    assert e["status"] == 404 and "9999" in e["message"]
    assert error_of(web.client.get("/api/v1/nope"))["status"] == 404
    assert error_of(web.client.delete("/api/v1/health"))["status"] == 405


def test_zoo_show_json_is_the_stored_part_of_the_rest_resource(web: Web, capsys: pytest.CaptureFixture[str]) -> None:
    """`zoo show --json` (a cold process: no query engine) prints the stored part of GET /adapters/{id} with the same
    keys and values; the resource adds only what needs the engine or other rows."""
    capsys.readouterr()
    assert web.zoo("show", "3", "--json") == 0
    shown = json.loads(capsys.readouterr().out)
    served = web.client.get("/api/v1/adapters/3").json
    assert set(served) - set(shown) == {"lineage", "from_lineage", "space", "neighbours", "predictions", "not_ready"}
    assert set(shown) <= set(served)
    for key in shown:
        if key == "source_uri":  # a server path: the API names it without the server's directories
            assert Path(shown[key]).name in served[key]
        else:
            assert served[key] == shown[key], key


def test_similar_by_id(web: Web) -> None:
    r = web.client.get("/api/v1/adapters/1/similar?k=5&method=module")
    assert r.status_code == 200 and len(r.json["results"]) == 5 and r.json["method"] == "module"
    scores = [x["score"] for x in r.json["results"]]
    assert scores == sorted(scores, reverse=True)
    same = web.client.get("/api/v1/adapters/1/similar?k=20&filter=task=qv").json["results"]
    assert same and all(x["labels"]["task"] == "qv" for x in same) and len(same) == N // 2
    assert error_of(web.client.get("/api/v1/adapters/1/similar?k=1001"))["status"] == 422
    assert error_of(web.client.get("/api/v1/adapters/1/similar?k=abc"))["type"] == "validation"
    assert error_of(web.client.get("/api/v1/adapters/1/similar?filter=task"))["status"] == 400
    for rank in ("99999999999999", "²", "-1", "4.0"):  # never a database error: out of range, not ASCII digits
        assert "whole number" in error_of(web.client.get(f"/api/v1/adapters/1/similar?filter=rank={rank}"))["message"]
        assert error_of(web.client.get(f"/api/v1/adapters?filter=rank={rank}"))["status"] == 400
    assert [x["adapter_id"] for x in web.client.get("/api/v1/adapters/1/similar?filter=rank=4&k=3").json["results"]]
    assert error_of(web.client.get("/api/v1/adapters/1/similar?method=nope"))["status"] == 422
    assert error_of(web.client.get("/api/v1/adapters/1/similar?space=nope"))["status"] == 404
    assert error_of(web.client.get("/api/v1/adapters/999/similar"))["status"] == 404


def test_similar_by_upload_in_every_shape(web: Web, tmp_path: Path) -> None:
    stored = web.adapters / "zoo" / "w03"
    by_id = web.client.get("/api/v1/adapters/4/similar?k=3").json
    r = web.client.post("/api/v1/similar", data={**peft_files(stored), "k": "3"}, content_type="multipart/form-data")
    assert r.status_code == 200, r.json
    # the file is stored adapter 4: answered as it, and said so
    assert r.json["stored_as"] == {"adapter_id": 4, "name": "w03"} and r.json["results"] == by_id["results"]
    assert by_id["stored_as"] is None
    r = web.client.post("/api/v1/similar", data={"file": [(io.BytesIO(zipped(stored)), "w03.zip")]}, content_type="multipart/form-data")
    assert r.status_code == 200 and r.json["stored_as"]["adapter_id"] == 4
    new = web.client.post("/api/v1/similar", data=peft_files(web.adapters / "outside" / "new"), content_type="multipart/form-data").json
    assert new["stored_as"] is None and new["results"]
    kohya = tmp_path / "k.safetensors"
    write_kohya_file(kohya)
    upload = {"file": [(io.BytesIO(kohya.read_bytes()), "k.safetensors")]}
    r = web.client.post("/api/v1/similar", data=upload, content_type="multipart/form-data")
    # read (its base model comes from its metadata), and this zoo has no space for it
    assert error_of(r)["status"] == 404 and "no embedding space 'sd-v1-5'" in error_of(r)["message"]
    r = web.client.post(
        "/api/v1/similar",
        data={"file": [(io.BytesIO(kohya.read_bytes()), "k.safetensors")], "space": "tiny"},
        content_type="multipart/form-data",
    )
    assert error_of(r)["status"] == 400 and "does not fit space tiny" in error_of(r)["message"]


@pytest.mark.parametrize(
    ("files", "status", "says"),
    [
        ([(b"\x00" * 64, "adapter.safetensors")], 422, "adapter.safetensors"),
        ([(b"PK\x03\x04 not really", "a.zip")], 422, "not a readable zip"),
        ([(b"\x80\x04K\x01.", "adapter_model.bin")], 422, "not an adapter upload"),
        ([(b"{}", "adapter_config.json")], 422, "adapter_model.safetensors is missing"),
    ],
)
def test_bad_uploads_are_refused_with_the_reason(web: Web, files: list, status: int, says: str) -> None:
    r = web.client.post("/api/v1/similar", data={"file": [(io.BytesIO(b), n) for b, n in files]}, content_type="multipart/form-data")
    e = error_of(r)
    assert e["status"] == status and says in e["message"]


def test_unsafe_zips_are_refused(web: Web) -> None:
    stored = web.adapters / "zoo" / "w03"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.write(stored / "adapter_config.json", "../adapter_config.json")
        zf.write(stored / "adapter_model.safetensors", "../adapter_model.safetensors")
    r = web.client.post("/api/v1/similar", data={"file": [(io.BytesIO(buf.getvalue()), "evil.zip")]}, content_type="multipart/form-data")
    assert error_of(r)["status"] == 422 and "unsafe member" in error_of(r)["message"]


def test_upload_limits_and_types(web: Web) -> None:
    small = create_app({"ZOO_DATABASE_URL": web.url, "ZOO_DATA_DIR": str(web.data_dir), "ZOO_MAX_UPLOAD_BYTES": 1000}).test_client()
    r = small.post("/api/v1/similar", data=peft_files(web.adapters / "zoo" / "w01"), content_type="multipart/form-data")
    assert error_of(r)["status"] == 413
    r = web.client.post("/api/v1/similar", json={"file": "x"})
    assert error_of(r)["status"] == 415


def test_predict_by_id_batch_and_upload(web: Web) -> None:
    r = web.client.post("/api/v1/predict/attributes", json={"adapter_id": 2})
    assert r.status_code == 200
    (p,) = r.json["predictions"]
    assert set(p) == {"query", "query_name", "stored_as", "space", "embedder_id", "predictors", "attributes", "confidence", "from_lineage"}
    assert p["from_lineage"]["edges"] >= 0 and "task" not in p["from_lineage"]["attributes"]  # its own task is given
    assert sum(c["probability"] for c in p["attributes"]["task"]) == pytest.approx(1.0, abs=1e-4)
    r = web.client.post("/api/v1/predict/performance", json={"adapter_ids": [1, 2, 3]})
    assert r.status_code == 200 and [p["query"] for p in r.json["predictions"]] == ["1", "2", "3"]
    m = r.json["predictions"][0]["metrics"]["test_accuracy"]
    assert m["low"] <= m["value"] <= m["high"] and m["interval"] == 0.9
    r = web.client.post("/api/v1/predict/attributes", data=peft_files(web.adapters / "outside" / "new"), content_type="multipart/form-data")
    assert r.status_code == 200 and r.json["predictions"][0]["query_name"] == "upload"
    assert r.json["predictions"][0]["from_lineage"] is None  # a file is not stored: it has no edges
    assert error_of(web.client.post("/api/v1/predict/attributes", json={}))["status"] == 400
    assert error_of(web.client.post("/api/v1/predict/attributes", json={"adapter_ids": list(range(1, 200))}))["status"] == 422
    assert error_of(web.client.post("/api/v1/predict/performance", json={"adapter_id": 999}))["status"] == 404


def test_a_prediction_stands_beside_what_was_given(web: Web) -> None:
    """A stored adapter's prediction is made without its own labels, so it may disagree with them: each attribute
    carries the given value and whether the top class is it, each metric the measured value and whether it lies in
    the interval, for every stored adapter."""
    ids = [a["id"] for a in web.client.get("/api/v1/adapters?per_page=100").json["results"]]
    attributes = web.client.post("/api/v1/predict/attributes", json={"adapter_ids": ids}).json["predictions"]
    metrics = web.client.post("/api/v1/predict/performance", json={"adapter_ids": ids}).json["predictions"]
    for p, m in zip(attributes, metrics, strict=True):
        given = web.client.get(f"/api/v1/adapters/{p['query']}").json
        c = p["confidence"]["task"]
        assert c["given"] == given["labels"].get("task")
        assert c["agrees"] == (None if c["given"] is None else p["attributes"]["task"][0]["value"] == c["given"])
        t = m["metrics"]["test_accuracy"]
        assert t["measured"] == given["measurements"].get("test_accuracy")
        if t["measured"] is not None:
            assert t["within"] == (t["low"] <= t["measured"] <= t["high"])
        assert p["predictors"]["task"] and p["stored_as"] is None
    assert any(p["confidence"]["task"]["given"] for p in attributes)


def test_a_stored_adapter_and_an_upload_of_its_export_get_one_answer(web: Web) -> None:
    """The export of a stored adapter, uploaded, is that adapter: the same predictions to the last digit, and the
    answer names it."""
    for adapter_id in (2, 5):
        export = web.client.get(f"/api/v1/adapters/{adapter_id}/download?format=peft").data
        upload = {"file": [(io.BytesIO(export), "export.zip")]}
        for part in ("attributes", "performance"):
            stored = web.client.post(f"/api/v1/predict/{part}", json={"adapter_id": adapter_id}).json["predictions"][0]
            uploaded = web.client.post(f"/api/v1/predict/{part}", data=dict(upload), content_type="multipart/form-data")
            assert uploaded.status_code == 200, uploaded.json
            got = uploaded.json["predictions"][0]
            assert got["stored_as"]["adapter_id"] == adapter_id
            for key in ("attributes", "confidence", "metrics", "from_lineage"):
                assert got.get(key) == stored.get(key), key
            upload = {"file": [(io.BytesIO(export), "export.zip")]}


def test_download_in_each_format(web: Web) -> None:
    r = web.client.get("/api/v1/adapters/1/download?format=peft")
    assert r.status_code == 200 and r.mimetype == "application/zip" and "attachment" in r.headers["Content-Disposition"]
    names = zipfile.ZipFile(io.BytesIO(r.data)).namelist()
    assert any(n.endswith("adapter_config.json") for n in names) and any(n.endswith("adapter_model.safetensors") for n in names)
    assert json.loads(r.headers["X-Zoo-Export-Notes"]) == []
    for fmt in ("diffusers", "kohya"):
        r = web.client.get(f"/api/v1/adapters/1/download?format={fmt}")
        assert r.status_code == 200 and r.headers["Content-Disposition"].endswith('.safetensors"')
    # the seeded zoo's modules are no SD UNet's: the kohya file keeps their names, and says so
    assert "keep their stored names" in json.loads(r.headers["X-Zoo-Export-Notes"])[0]
    assert error_of(web.client.get("/api/v1/adapters/1/download?format=onnx"))["status"] == 422
    assert error_of(web.client.get("/api/v1/adapters/999/download"))["status"] == 404


def test_spaces_and_the_map(web: Web) -> None:
    (space,) = web.client.get("/api/v1/spaces").json["spaces"]
    assert space["name"] == "tiny"
    assert {e["method"] for e in space["embedders"]} == {"module_sketch", "raw_factors", "input_gram_sketch", "w2t"}
    assert all(e["embedded"] >= N for e in space["embedders"])
    m = web.client.get("/api/v1/spaces/tiny/map?color_by=task").json
    assert m["method"] == "w2t" and m["count"] >= N and len(m["points"]) == m["count"]
    by_id = {p["id"]: p for p in m["points"]}
    assert by_id[1]["value"] == "qk" and by_id[2]["value"] == "qv" and "task" in m["color_keys"]
    few = web.client.get("/api/v1/spaces/tiny/map?limit=3&highlight=7").json
    assert len(few["points"]) == 3 and 7 in [p["id"] for p in few["points"]]
    assert error_of(web.client.get("/api/v1/spaces/nope/map"))["status"] == 404
    assert error_of(web.client.get("/api/v1/spaces/tiny/map?limit=0"))["status"] == 422
    assert error_of(web.client.get("/api/v1/jobs/999"))["status"] == 404


def test_ingest_needs_a_token_and_stays_in_the_import_root(web: Web, tmp_path: Path) -> None:
    body = {"paths": ["outside/new"]}
    assert error_of(web.client.post("/api/v1/ingest", json=body))["status"] == 401
    assert error_of(web.client.post("/api/v1/ingest", json=body, headers={"Authorization": "Bearer zoo_wrong"}))["status"] == 401
    assert web.zoo("token", "create", "tests", "--json") == 0
    from zoo.store import tokens
    from zoo.store.session import session_factory

    with session_factory(web.url).begin() as session:
        _, token = tokens.create_token(session, "web-test", "write")
    auth = {"Authorization": f"Bearer {token}"}
    for path in ("/etc", "../../etc/passwd", str(web.adapters.parent)):
        e = error_of(web.client.post("/api/v1/ingest", json={"paths": [path]}, headers=auth))
        assert e["status"] == 400 and "outside the import root" in e["message"]
    link = web.adapters / "escape"
    if not link.exists():
        link.symlink_to(tmp_path)
    assert "outside the import root" in error_of(web.client.post("/api/v1/ingest", json={"paths": ["escape"]}, headers=auth))["message"]
    r = web.client.post("/api/v1/ingest", json={"paths": ["outside/new", "zoo/w00"], "base_model": "tiny"}, headers=auth)
    assert r.status_code == 202 and r.json["counts"]["total"] == 2
    job = _wait(web, r.json["id"])
    assert job["state"] == "done" and sorted(i["state"] for i in job["items"]) == ["done", "duplicate"]
    assert job["created_by"] == "web-test"
    upload = {**peft_files(web.adapters / "zoo" / "w05"), "base_model": "tiny"}
    r = web.client.post("/api/v1/ingest", data=upload, headers=auth, content_type="multipart/form-data")
    assert r.status_code == 202
    job = _wait(web, r.json["id"])
    assert [i["state"] for i in job["items"]] == ["duplicate"]
    # the saved upload is removed right after its item is finished (the item's state commits first, so that a crash
    # between the two leaves a file for `zoo check`, never an item whose file is gone): wait for it briefly
    deadline = time.monotonic() + 10
    while list((web.data_dir / "uploads").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not list((web.data_dir / "uploads").iterdir())
    listed = web.client.get("/api/v1/jobs").json["jobs"]
    assert [j["id"] for j in listed][:2] == [job["id"], job["id"] - 1]
    assert web.zoo("token", "revoke", "2") == 0
    assert error_of(web.client.post("/api/v1/ingest", json=body, headers=auth))["status"] == 401


def test_label_edits_need_a_token_and_reach_search_and_filters(web: Web) -> None:
    body = {"labels": {"style": "watercolour"}, "measurements": {"test_accuracy": 0.91}}
    assert error_of(web.client.put("/api/v1/adapters/3/labels", json=body))["status"] == 401
    from zoo.store import tokens
    from zoo.store.session import session_factory

    with session_factory(web.url).begin() as session:
        _, token = tokens.create_token(session, "labeller", "write")
    auth = {"Authorization": f"Bearer {token}"}
    r = web.client.put("/api/v1/adapters/3/labels", json=body, headers=auth)
    assert r.status_code == 200 and r.json["labels"]["style"] == "watercolour" and r.json["measurements"]["test_accuracy"] == 0.91
    found = web.client.get("/api/v1/adapters?q=watercolour").json
    assert [a["id"] for a in found["results"]] == [3]
    near = web.client.get("/api/v1/adapters/1/similar?k=20&filter=style=watercolour").json["results"]
    assert [x["adapter_id"] for x in near] == [3] and near[0]["labels"]["style"] == "watercolour"
    assert error_of(web.client.put("/api/v1/adapters/3/labels", json={}, headers=auth))["status"] == 400
    assert error_of(web.client.put("/api/v1/adapters/999/labels", json=body, headers=auth))["status"] == 404
    bad = {"measurements": {"test_accuracy": "high"}}
    assert error_of(web.client.put("/api/v1/adapters/3/labels", json=bad, headers=auth))["status"] == 422


def test_delete_needs_a_token_and_the_adapter_leaves_every_index(web: Web) -> None:
    assert error_of(web.client.delete("/api/v1/adapters/9"))["status"] == 401
    from zoo.store import tokens
    from zoo.store.session import session_factory

    with session_factory(web.url).begin() as session:
        _, token = tokens.create_token(session, "remover", "admin")
    auth = {"Authorization": f"Bearer {token}"}
    assert 9 in [x["adapter_id"] for x in web.client.get("/api/v1/adapters/10/similar?k=20").json["results"]]  # the engine holds it
    r = web.client.delete("/api/v1/adapters/9", headers=auth)
    assert r.status_code == 200 and r.json == {"id": 9, "name": "w08", "deleted": True}
    assert error_of(web.client.get("/api/v1/adapters/9"))["status"] == 404
    for method in ("hybrid", "module", "sketch", "w2t"):  # the running engine dropped it from both indexes
        found = web.client.get(f"/api/v1/adapters/10/similar?k=20&method={method}").json["results"]
        assert 9 not in [x["adapter_id"] for x in found] and len(found) >= N - 2
    assert 9 not in [a["id"] for a in web.client.get("/api/v1/adapters?per_page=100").json["results"]]
    assert error_of(web.client.delete("/api/v1/adapters/9", headers=auth))["status"] == 404
    assert web.zoo("check") == 0  # index files, module store and map agree with the database and its tombstone
    # a fresh engine (another process) reads the index files, which `zoo embed` brings up to date
    assert web.zoo("embed", "--json") == 0
    fresh = create_app({"ZOO_DATABASE_URL": web.url, "ZOO_DATA_DIR": str(web.data_dir)}).test_client()
    found = fresh.get("/api/v1/adapters/10/similar?k=20").json["results"]
    assert 9 not in [x["adapter_id"] for x in found]
    assert 9 not in [p["id"] for p in fresh.get("/api/v1/spaces/tiny/map").json["points"]]


def test_an_ingest_job_goes_on_past_a_hostile_file_and_names_it(web: Web) -> None:
    from zoo.store import tokens
    from zoo.store.session import session_factory

    with session_factory(web.url).begin() as session:
        _, token = tokens.create_token(session, "hostile", "write")
    good = (web.adapters / "zoo" / "w01" / "adapter_model.safetensors").read_bytes()
    (web.adapters / "outside" / "truncated.safetensors").write_bytes(good[: len(good) // 2])
    (web.adapters / "outside" / "pickle.bin").write_bytes(b"\x80\x04cos\nsystem\n.")
    before = web.client.get("/api/v1/health").json["adapters"]
    body = {"paths": ["outside/truncated.safetensors", "outside/pickle.bin", "zoo/w01"], "base_model": "tiny"}
    r = web.client.post("/api/v1/ingest", json=body, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 202
    items = _wait(web, r.json["id"])["items"]
    assert [i["state"] for i in items] == ["failed", "failed", "duplicate"]
    assert "truncated.safetensors" in items[0]["reason"] and "pickle.bin" in items[1]["reason"]
    assert web.client.get("/api/v1/health").json["adapters"] == before  # nothing stored for them


def _wait(web: Web, job_id: int) -> dict:
    import time

    for _ in range(600):
        job = web.client.get(f"/api/v1/jobs/{job_id}").json
        if job["state"] == "done":
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish: {job}")


#: what anyone may call when reads need a token (webapp/security.py OPEN_ENDPOINTS): widening it is a decision
OPEN = {"api.health", "openapi.spec", "ui.api_docs_page", "static", "ui.sign_in", "ui.sign_out"}
#: a value for each path argument of the app's routes
SAMPLES = {"adapter_id": 1, "job_id": 1, "name": "tiny", "filename": "app.css", "key": "task"}


def test_reads_can_require_a_token(web: Web) -> None:
    """With ZOO_READ_TOKEN_REQUIRED every route of the app's own URL map, with every method it accepts (HEAD, OPTIONS
    and the POST reads included), is a 401 without a token, but for the small open list: a new route cannot escape."""
    from webapp.security import OPEN_ENDPOINTS, TOKEN_COOKIE
    from zoo.store import tokens
    from zoo.store.session import session_factory

    assert OPEN_ENDPOINTS == OPEN
    app = create_app({"ZOO_DATABASE_URL": web.url, "ZOO_DATA_DIR": str(web.data_dir), "ZOO_READ_TOKEN_REQUIRED": "1"})
    closed = app.test_client()
    walked = set()
    for rule in app.url_map.iter_rules():
        built = rule.build({arg: SAMPLES[arg] for arg in rule.arguments})
        assert built, rule.rule
        url = built[1]
        for method in sorted(rule.methods or ()):
            r = closed.open(url, method=method)
            walked.add(rule.endpoint)
            if rule.endpoint in OPEN:
                assert r.status_code != 401, (method, url)
            else:
                assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer"), (method, url, r.status_code)
                if url.startswith("/api/") and method != "HEAD":
                    assert error_of(r)["type"] == "unauthorized"
    assert len(walked) >= 25
    page = closed.get("/adapters/1?x=1")  # a page's 401 is a page to sign in on, back to where it was
    assert page.mimetype == "text/html" and "<title>Sign in · zoo</title>" in page.get_data(as_text=True)
    assert 'name="next" value="/adapters/1?x=1"' in page.get_data(as_text=True)

    with session_factory(web.url).begin() as session:
        _, token = tokens.create_token(session, "reader")
    auth = {"Authorization": f"Bearer {token}"}
    assert closed.get("/api/v1/adapters/1", headers=auth).status_code == 200
    assert closed.head("/api/v1/adapters", headers=auth).status_code == 200
    assert closed.post("/api/v1/predict/attributes", json={"adapter_id": 1}, headers=auth).status_code == 200
    assert error_of(closed.get("/api/v1/adapters/1", headers={"Authorization": "Bearer zoo_wrong"}))["status"] == 401

    assert closed.post("/sign-in", data={"token": "zoo_wrong", "next": "/map"}).status_code == 401
    r = closed.post("/sign-in", data={"token": token, "next": "//evil.example/x"})  # never sent off the site
    assert r.status_code == 303 and r.headers["Location"] == "/"
    cookie = closed.get_cookie(TOKEN_COOKIE)
    assert cookie and cookie.http_only and cookie.same_site == "Lax"
    assert closed.get("/adapters/1").status_code == 200 and closed.get("/api/v1/adapters/1").status_code == 200  # reads take it
    assert "sign out" in closed.get("/").get_data(as_text=True)
    assert closed.delete("/api/v1/adapters/1").status_code == 403  # a reader's cookie never deletes
    closed.post("/sign-out")
    assert closed.get_cookie(TOKEN_COOKIE) is None and closed.get("/").status_code == 401


def test_pages_render_with_their_json_twins(web: Web) -> None:
    for path, twin in (("/", "/api/v1/adapters"), ("/adapters/1", "/api/v1/adapters/1"), ("/jobs", "/api/v1/jobs")):
        r = web.client.get(path)
        assert r.status_code == 200 and r.mimetype == "text/html"
        assert f'rel="alternate" type="application/json" href="{twin}' in r.get_data(as_text=True)
    page = web.client.get("/adapters/1").get_data(as_text=True)
    assert "Nearest neighbours" in page and "without this adapter's own labels" in page and "format=kohya" in page
    # the given task first, and the prediction beside it, with the predictor that made it
    given = web.client.get("/api/v1/adapters/1").json["labels"]["task"]
    assert f'<span class="chip given">{given}</span>' in page and "by knn " in page or "by the W2T heads" in page
    assert web.client.get("/map").status_code == 200 and web.client.get("/similar").status_code == 200
    r = web.client.post("/similar", data=peft_files(web.adapters / "zoo" / "w03"), content_type="multipart/form-data")
    assert r.status_code == 200 and "Nearest to" in r.get_data(as_text=True) and "This file is stored adapter" in r.get_data(as_text=True)
    r = web.client.get("/adapters/9999")
    assert r.status_code == 404 and r.mimetype == "text/html" and "no adapter with id 9999" in r.get_data(as_text=True)
    for html in (web.client.get(p).get_data(as_text=True) for p in ("/", "/adapters/1", "/map")):
        assert "https://" not in html and "http://" not in html.replace('href="http://localhost', "")


# --- hostile requests, server paths, one error vocabulary, security headers, read tokens ---------------


def upload_of(name: str, data: bytes) -> dict:
    return {"file": [(io.BytesIO(data), name)]}


def test_hostile_bodies_and_names_are_4xx_never_500(web: Web, tmp_path: Path) -> None:
    """JSON nested 10,000 deep (a RecursionError once) or past MAX_JSON_DEPTH is a 400; an upload named upload.zip.zip
    (a FileExistsError once) is read; a long .safetensors name keeps its suffix (it was cut off and refused)."""
    for depth in (10_000, 40):
        deep = "[" * depth + "]" * depth
        for url in ("/api/v1/predict/attributes", "/api/v1/predict/performance"):
            e = error_of(web.client.post(url, data=deep, content_type="application/json"))
            assert e["status"] == 400 and e["type"] == "bad_request" and "nested deeper" in e["message"]
    z = zipped(web.adapters / "zoo" / "w03")
    r = web.client.post("/api/v1/similar", data={**upload_of("upload.zip.zip", z), "k": "3"}, content_type="multipart/form-data")
    assert r.status_code == 200 and r.json["stored_as"]["name"] == "w03" and r.json["query"] == "upload.zip.zip"
    r = web.client.post("/api/v1/predict/attributes", data=upload_of("upload.zip.zip", z), content_type="multipart/form-data")
    assert r.status_code == 200 and r.json["predictions"][0]["attributes"]["task"]
    kohya = tmp_path / "k.safetensors"
    write_kohya_file(kohya)
    long = "a-very-long-name-" * 20 + ".safetensors"
    e = error_of(web.client.post("/api/v1/similar", data=upload_of(long, kohya.read_bytes()), content_type="multipart/form-data"))
    assert e["status"] == 404 and "no embedding space 'sd-v1-5'" in e["message"]  # read as a kohya file


def _no_server_path(web: Web, body: str) -> None:
    for path in {str(web.data_dir), str(web.data_dir.resolve()), str(web.adapters), str(web.adapters.resolve())}:
        assert path not in body, body[:2000]


def test_no_server_path_in_a_response(web: Web) -> None:
    """Upload errors, an upload search's `query`, the find-similar page and an ingest job's items name the upload's
    file, never the data dir's temporary directory; a path under the import root is named from $ZOO_IMPORT_ROOT."""
    bad = upload_of("broken.safetensors", b"\x00" * 64)
    for url in ("/api/v1/similar", "/api/v1/predict/attributes", "/similar"):
        r = web.client.post(url, data=dict(bad), content_type="multipart/form-data")
        assert r.status_code == 422 and "broken.safetensors: not a safetensors file" in r.get_data(as_text=True)
        _no_server_path(web, r.get_data(as_text=True))
        bad = upload_of("broken.safetensors", b"\x00" * 64)  # a stream is read once
    stored = web.adapters / "zoo" / "w03"
    for url in ("/api/v1/similar", "/api/v1/predict/performance"):
        r = web.client.post(url, data=upload_of("w03.zip", zipped(stored)), content_type="multipart/form-data")
        assert r.status_code == 200 and "w03.zip" in r.get_data(as_text=True)
        _no_server_path(web, r.get_data(as_text=True))
    r = web.client.post("/similar", data=peft_files(stored), content_type="multipart/form-data")
    assert r.status_code == 200 and "Nearest to" in r.get_data(as_text=True)
    _no_server_path(web, r.get_data(as_text=True))

    from zoo.store import tokens
    from zoo.store.session import session_factory

    with session_factory(web.url).begin() as session:
        _, token = tokens.create_token(session, "paths", "write")
    auth = {"Authorization": f"Bearer {token}"}
    r = web.client.post("/api/v1/ingest", data={**upload_of("broken.safetensors", b"\x00" * 64), "base_model": "tiny"}, headers=auth)
    assert r.status_code == 202
    _no_server_path(web, r.get_data(as_text=True))
    (item,) = _wait(web, r.json["id"])["items"]
    assert item["state"] == "failed" and item["source"] == "broken.safetensors"
    assert re.match(r"upload:[0-9a-f]{32}/broken\.safetensors: ", item["reason"]), item["reason"]  # as the adapter would be stored
    for url in (f"/api/v1/jobs/{r.json['id']}", f"/jobs/{r.json['id']}", "/api/v1/jobs", "/jobs"):
        _no_server_path(web, web.client.get(url).get_data(as_text=True))
    e = error_of(web.client.post("/api/v1/ingest", json={"paths": ["/etc"]}, headers=auth))
    assert "outside the import root $ZOO_IMPORT_ROOT" in e["message"]


def test_one_error_vocabulary(web: Web) -> None:
    """Every error's `type` is one snake_case word of webapp.errors.ERROR_TYPES, which the OpenAPI document lists;
    pages show its title, never an exception's class name."""
    from webapp.errors import ERROR_TYPES

    spec = web.client.get("/api/v1/openapi.json").json
    assert spec["components"]["schemas"]["ErrorDetail"]["properties"]["type"]["enum"] == list(ERROR_TYPES)
    assert all(kind == kind.lower() and " " not in kind for kind in ERROR_TYPES)
    cases = [
        (web.client.get("/api/v1/adapters/9999"), "not_found"),
        (web.client.get("/api/v1/nope"), "not_found"),
        (web.client.delete("/api/v1/health"), "method_not_allowed"),
        (web.client.get("/api/v1/adapters/1/similar?filter=task"), "bad_request"),
        (web.client.get("/api/v1/adapters/1/similar?k=abc"), "validation"),
        (web.client.post("/api/v1/similar", data=upload_of("a.safetensors", b"\x00"), content_type="multipart/form-data"), "unprocessable"),
        (web.client.post("/api/v1/similar", json={"file": "x"}), "unsupported_media_type"),
        (web.client.post("/api/v1/ingest", json={"paths": ["x"]}), "unauthorized"),
        (web.client.get("/api/v1/spaces/nope/map"), "not_found"),
    ]
    for response, kind in cases:
        assert error_of(response)["type"] == kind, (response.request.path, response.json)
    page = web.client.get("/adapters/9999").get_data(as_text=True)
    assert "<title>Not found · zoo</title>" in page and "NotFoundError" not in page
    page = web.client.post("/jobs").get_data(as_text=True)
    assert "<title>Method not allowed · zoo</title>" in page and "<h1>Method not allowed <span" in page


def test_security_headers_on_every_response(web: Web) -> None:
    """CSP, nosniff, no framing and a referrer policy on pages, JSON, files, downloads and errors; the pages carry no
    inline script or event handler, so the CSP's script-src 'self' runs them whole (tests/test_browser.py drives them)."""
    from webapp.security import SECURITY_HEADERS

    responses = [web.client.get(p) for p in ("/", "/adapters/1", "/map", "/similar", "/jobs", "/jobs/1", "/api/v1/docs", "/nope")]
    responses += [web.client.get(p) for p in ("/api/v1/adapters/1", "/api/v1/nope", "/static/app.js", "/api/v1/adapters/1/download")]
    responses += [web.client.head("/api/v1/health"), web.client.options("/api/v1/health"), web.client.delete("/api/v1/adapters/1")]
    for r in responses:
        assert all(r.headers.get(name) == value for name, value in SECURITY_HEADERS.items()), (r.request.path, dict(r.headers))
    assert "script-src 'self';" in SECURITY_HEADERS["Content-Security-Policy"]
    for r in responses[:8]:
        page = r.get_data(as_text=True)
        assert "<script>" not in page and " on" + "change=" not in page and " on" + "click=" not in page and "style=" not in page


def test_gunicorn_refusals_are_json() -> None:
    """What gunicorn refuses before the app sees it (a request line past its limit: 414) is the error shape as JSON,
    through gunicorn's own error path."""
    import logging
    import socket

    from gunicorn import util
    from gunicorn.http.errors import LimitRequestLine
    from gunicorn.workers.base import Worker

    from webapp.security import SECURITY_HEADERS, gunicorn_errors_as_json, write_json_error

    original = util.write_error
    gunicorn_errors_as_json()
    try:
        ours, theirs = socket.socketpair()
        worker = type("W", (), {"log": logging.getLogger("test"), "cfg": None})()
        Worker.handle_error(worker, None, ours, ("127.0.0.1", 1), LimitRequestLine(9000, 4094))
        ours.close()
        head, _, body = theirs.recv(1 << 16).decode().partition("\r\n\r\n")
        theirs.close()
    finally:
        util.write_error = original
    assert util.write_error is not write_json_error
    assert head.startswith("HTTP/1.1 414 ") and "Content-Type: application/json" in head
    assert all(f"{name}: {value}" in head for name, value in SECURITY_HEADERS.items())
    error = json.loads(body)["error"]
    assert error == {"status": 414, "type": "uri_too_long", "message": "Request Line is too large (9000 > 4094)", "detail": None}
