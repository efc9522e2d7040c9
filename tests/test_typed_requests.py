"""Requests typed at the door they came in by: a query's id or path decided by its text (never by which files the working
directory holds), and filters whose field and label keys never shadow each other. On a copy of the seeded zoo
(tests/conftest.py `seeded`: w00..w11 as `tiny`, tasks qk and qv, embedded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flask.testing import FlaskClient

from tests.conftest import SeededZoo
from webapp import create_app
from zoo.cli import main


def zoo_json(zoo: SeededZoo, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[dict], str]:
    capsys.readouterr()
    rc = main(["--db", zoo.url, "--data-dir", str(zoo.data_dir), *args, "--json"])
    out = capsys.readouterr()
    return rc, [json.loads(line) for line in out.out.splitlines() if line.strip()], out.err


@pytest.fixture(scope="module")
def client(seeded: SeededZoo) -> FlaskClient:
    app = create_app({"ZOO_DATABASE_URL": seeded.url, "ZOO_DATA_DIR": str(seeded.data_dir), "TESTING": True})
    return app.test_client()


def test_a_file_named_like_an_id_does_not_shadow_the_id(
    seeded: SeededZoo, client: FlaskClient, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    rc, (want,), _ = zoo_json(seeded, capsys, "search", "1", "-k", "3")
    assert rc == 0 and want["query"] == "1" and want["query_name"] == "w00"
    (tmp_path / "1").write_text("not an adapter")
    # the command line: digits are the stored adapter, whatever the working directory holds
    rc, (found,), _ = zoo_json(seeded, capsys, "search", "1", "-k", "3")
    assert rc == 0 and found == want
    rc, (predicted,), _ = zoo_json(seeded, capsys, "predict", "1")
    assert rc == 0 and predicted["query_name"] == "w00"
    # the file is reached as a path
    rc, _, err = zoo_json(seeded, capsys, "search", "./1")
    assert rc == 2 and "unsupported file type" in err
    # the API never reads a path: the server's working directory holding a file named 1 changes nothing
    served = client.get("/api/v1/adapters/1/similar?k=3")
    assert served.status_code == 200 and served.get_json()["query_name"] == "w00"
    assert [r["adapter_id"] for r in served.get_json()["results"]] == [r["adapter_id"] for r in want["results"]]
    predicted = client.post("/api/v1/predict/attributes", json={"adapter_id": 1})
    assert predicted.status_code == 200, predicted.get_json()


def ids_of(found: dict) -> set[int]:
    return {r["id"] if "id" in r else r["adapter_id"] for r in found["results"]}


def test_a_label_named_like_a_field_is_filtered_in_its_own_namespace(
    seeded: SeededZoo, client: FlaskClient, capsys: pytest.CaptureFixture[str]
) -> None:
    from zoo.store.labels import write_labels
    from zoo.store.session import session_factory, write_transaction

    rc, (before,), _ = zoo_json(seeded, capsys, "list", "--filter", "task=qv", "--per-page", "100")
    rc, (ranked,), _ = zoo_json(seeded, capsys, "list", "--filter", "rank=4", "--per-page", "100")
    assert rc == 0 and ranked["total"] == 12  # every seeded adapter has rank 4
    with write_transaction(session_factory(seeded.url)) as session:
        for adapter_id in (1, 3):
            write_labels(session, adapter_id, {"rank": "8", "format": "gguf"}, {})
    # the label: through the command line, the catalog API and similarity search on both doors
    rc, (found,), _ = zoo_json(seeded, capsys, "list", "--filter", "label.rank=8")
    assert rc == 0 and ids_of(found) == {1, 3} and found["filters"] == {"label.rank": "8"}
    rc, (found,), _ = zoo_json(seeded, capsys, "list", "--filter", "label.format=gguf", "--filter", "task=qk")
    assert rc == 0 and ids_of(found) == {1, 3}
    served = client.get("/api/v1/adapters?filter=label.rank=8&per_page=100").get_json()
    assert ids_of(served) == {1, 3} and served["facets"]["label:rank"] == [{"value": "8", "count": 2}]
    rc, (similar,), _ = zoo_json(seeded, capsys, "search", "2", "-k", "20", "--filter", "label.rank=8")
    assert rc == 0 and ids_of(similar) == {1, 3}
    fresh = create_app({"ZOO_DATABASE_URL": seeded.url, "ZOO_DATA_DIR": str(seeded.data_dir), "TESTING": True}).test_client()
    similar = fresh.get("/api/v1/adapters/2/similar?k=20&filter=label.rank=8").get_json()
    assert ids_of(similar) == {1, 3}
    # the field keeps its key, and a filter written before labels had a namespace answers as it did
    rc, (still,), _ = zoo_json(seeded, capsys, "list", "--filter", "rank=4", "--per-page", "100")
    assert still["total"] == 12 and not client.get("/api/v1/adapters?filter=rank=8").get_json()["results"]
    rc, (after,), _ = zoo_json(seeded, capsys, "list", "--filter", "task=qv", "--per-page", "100")
    assert after["results"] == before["results"] and after["filters"] == before["filters"] == {"task": "qv"}
    # the search page's facet of the label links with the label's filter, the field's with the field's
    page = fresh.get("/?per_page=100").get_data(as_text=True)
    assert "filter=label.rank%3D8" in page and "filter=rank%3D4" in page and "filter=task%3Dqv" in page


def test_filter_syntax() -> None:
    from zoo.errors import UsageError
    from zoo.store import repository
    from zoo.store.filters import SOURCE_KEYS, Filter, facet_filter_name, filter_of, parse_filter

    assert parse_filter("rank=8") == Filter("field", "rank", "8") and parse_filter("label.rank=8") == Filter("label", "rank", "8")
    assert parse_filter("task=qv") == parse_filter("label.task=qv") == Filter("label", "task", "qv")  # one filter, one name
    assert repository.parse_filters(["label.task=qv", "label.format=gguf", "format=peft"]) == {
        "task": "qv",
        "label.format": "gguf",
        "format": "peft",
    }
    label = parse_filter("label.label.x=1")  # a label whose own key starts with the prefix
    assert label == Filter("label", "label.x", "1") and filter_of(label.name, "1") == label and label.text == "label.label.x=1"
    for bad in ("label.=v", "rank", "=v", "rank="):
        with pytest.raises(UsageError, match="filter"):
            parse_filter(bad)
    assert [facet_filter_name(f) for f in ("label:rank", "label:task", "rank", "author")] == ["label.rank", "task", "rank", "author"]
    assert tuple(repository.SOURCE_FIELDS) == SOURCE_KEYS  # the filter syntax's fields are the store's
