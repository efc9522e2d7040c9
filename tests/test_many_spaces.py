"""A zoo of many base models: toy PEFT adapters beside adapters at the real widths of Llama-3-8B, Mistral-7B (PEFT
directories), SDXL (kohya, with 3×3 conv LoRA) and Flux.1-dev (diffusers), one layer or block each
(zoo/reference/real_shapes.py). `zoo embed` makes one space per base model; a search stays inside its space, a
query of another base is refused, the query engine keeps loaded spaces within ZOO_SPACES_BYTES and answers the
same when it has to drop and load them again, and the web pages let a user pick the space."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from werkzeug.serving import make_server

from embed.serving import resources, spaces_resource
from embed.serving.engine import QueryEngine
from embed.serving.refs import StoredId
from tests.factories import write_random_peft_adapters
from webapp import create_app
from zoo.cli import main
from zoo.errors import UsageError
from zoo.reference.real_shapes import write_adapter
from zoo.store.blobs import BlobStore
from zoo.store.session import make_engine, session_factory, upgrade

#: real-width adapters per kind: families × members, one layer or block each
FAMILIES, MEMBERS = 2, 2
KINDS = ("llama3-8b", "mistral-7b", "sdxl", "flux1-dev")
#: the space each kind lands in: its PEFT config's base model, the SDXL file's training metadata, or --base-model
SPACES = {
    "llama3-8b": "meta-llama/Meta-Llama-3-8B",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "sdxl": "sd_xl_base_1.0.safetensors",
    "flux1-dev": "black-forest-labs/FLUX.1-dev",
    "toy": "tiny",
}
TOYS = 4


@dataclass
class Zoo:
    root: Path
    url: str
    data_dir: Path
    ids: dict[str, dict[str, int]]  # kind → adapter name → id

    def run(self, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = main(["--db", self.url, "--data-dir", str(self.data_dir), *args])
        out = capsys.readouterr()
        return rc, out.out, out.err

    def engine(self) -> QueryEngine:
        return QueryEngine(session_factory(self.url), BlobStore(self.data_dir / "blobs"), self.data_dir)

    def kind_of(self, adapter_id: int) -> str:
        return next(kind for kind, named in self.ids.items() if adapter_id in named.values())


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zoo]:
    """Toy adapters (base `tiny`) and FAMILIES × MEMBERS real-width adapters of each kind, labelled by family,
    ingested by `zoo ingest` and embedded by `zoo embed` (SQLite)."""
    root = tmp_path_factory.mktemp("many-spaces")
    url = f"sqlite:///{root / 'zoo.db'}"
    upgrade(url)
    data_dir = root / "data"
    base = ["--db", url, "--data-dir", str(data_dir)]
    write_random_peft_adapters(root / "src" / "toy", TOYS)
    rows = ["name,family"]
    for kind in KINDS:
        for f in range(FAMILIES):
            for m in range(MEMBERS):
                write_adapter(kind, root / "src" / kind, f, m, layers=1)
                rows.append(f"{kind}-f{f}-m{m},{kind}-f{f}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    assert main([*base, "ingest", str(root / "src" / "toy"), "--base-model", "tiny", "--json"]) == 0  # each ingest embeds its space
    for kind in KINDS:
        named = ["--base-model", SPACES[kind]] if kind == "flux1-dev" else []  # a diffusers file names no base model
        assert main([*base, "ingest", str(root / "src" / kind), "--labels", str(root / "labels.csv"), *named, "--json"]) == 0
    from sqlalchemy import select

    from zoo.store.models import Adapter

    ids: dict[str, dict[str, int]] = {kind: {} for kind in SPACES}
    with session_factory(url)() as session:
        for adapter_id, name, base_model in session.execute(select(Adapter.id, Adapter.name, Adapter.base_model)):
            ids[next(k for k, s in SPACES.items() if s == base_model)][name] = adapter_id
    assert {k: len(v) for k, v in ids.items()} == {**{k: FAMILIES * MEMBERS for k in KINDS}, "toy": TOYS}
    yield Zoo(root, url, data_dir, ids)
    make_engine(url).dispose()


def test_embed_makes_one_space_per_base_model(zoo: Zoo) -> None:
    with session_factory(zoo.url)() as session:
        spaces = {s["name"]: s for s in spaces_resource.list_spaces(session)}
    assert set(spaces) == set(SPACES.values())
    for kind, name in SPACES.items():
        assert spaces[name]["base_model"] == name and spaces[name]["adapters"] == len(zoo.ids[kind])


def test_each_space_searched_returns_only_its_own_base(zoo: Zoo, capsys: pytest.CaptureFixture[str]) -> None:
    for kind, named in zoo.ids.items():
        for name, adapter_id in named.items():
            rc, out, err = zoo.run(capsys, "search", str(adapter_id), "-k", "20", "--json")  # the space of its own base
            assert rc == 0, err
            found = json.loads(out)
            hits = [h["adapter_id"] for h in found["results"]]
            assert found["space"] == SPACES[kind]
            assert sorted(hits) == sorted(set(named.values()) - {adapter_id})  # all of its base, none of another
            if kind != "toy":  # the family shares half of each module's rank: its other member comes first
                assert found["results"][0]["labels"]["family"] == name.rsplit("-m", 1)[0]


def test_a_file_query_is_searched_in_its_own_space(zoo: Zoo, capsys: pytest.CaptureFixture[str]) -> None:
    path = zoo.root / "src" / "sdxl" / "sdxl-f1-m0.safetensors"  # a kohya file with conv LoRA, read and not stored
    rc, out, err = zoo.run(capsys, "search", str(path), "-k", "3", "--json")
    assert rc == 0, err
    found = json.loads(out)
    assert found["space"] == SPACES["sdxl"] and {zoo.kind_of(h["adapter_id"]) for h in found["results"]} == {"sdxl"}
    # the file is a stored adapter of that space: found to be it, and answered as it (without itself)
    stored = zoo.ids["sdxl"]["sdxl-f1-m0"]
    assert found["stored_as"]["adapter_id"] == stored and stored not in [h["adapter_id"] for h in found["results"]]
    rc, out, err = zoo.run(capsys, "search", str(stored), "-k", "3", "--json")
    assert json.loads(out)["results"] == found["results"]


@pytest.mark.parametrize(
    "kind,space",
    [("llama3-8b", "mistral-7b"), ("sdxl", "flux1-dev"), ("flux1-dev", "llama3-8b"), ("toy", "sdxl"), ("mistral-7b", "toy")],
)
def test_a_query_of_another_base_is_refused(zoo: Zoo, capsys: pytest.CaptureFixture[str], kind: str, space: str) -> None:
    adapter_id = next(iter(zoo.ids[kind].values()))
    rc, out, err = zoo.run(capsys, "search", str(adapter_id), "--space", SPACES[space])
    assert rc == 2 and not out
    assert f"is an adapter of {SPACES[kind]!r}, not of space {SPACES[space]!r}" in err


def test_a_query_that_fits_another_base_by_shape_is_refused_too(zoo: Zoo) -> None:
    engine = zoo.engine()
    with session_factory(zoo.url)() as session, pytest.raises(UsageError) as refused:
        resources.search(engine, session, StoredId(zoo.ids["mistral-7b"]["mistral-7b-f0-m0"]), 5, SPACES["llama3-8b"])
    assert SPACES["mistral-7b"] in str(refused.value) and SPACES["llama3-8b"] in str(refused.value)


def _answers(engine: QueryEngine, zoo: Zoo, order: list[int]) -> list[tuple[str, list[int], list[float]]]:
    """Each query's space, hit ids and scores, in the order asked."""
    out = []
    with session_factory(zoo.url)() as session:
        for adapter_id in order:
            found = resources.search(engine, session, StoredId(adapter_id), 5, method="module")
            out.append((str(found["space"]), [h["adapter_id"] for h in found["results"]], [h["score"] for h in found["results"]]))
    return out


def _round_robin(zoo: Zoo) -> list[int]:
    """One adapter of each space in turn, twice over each adapter."""
    per_space = [list(named.values()) for named in zoo.ids.values()]
    return [ids[i % len(ids)] for i in range(2 * max(map(len, per_space))) for ids in per_space]


@pytest.mark.slow
def test_a_tiny_budget_answers_every_space_in_turn_as_a_large_one(zoo: Zoo, monkeypatch: pytest.MonkeyPatch) -> None:
    order = _round_robin(zoo)
    monkeypatch.setenv("ZOO_SPACES_BYTES", str(1 << 40))
    large = zoo.engine()
    expected = _answers(large, zoo, order)
    assert list(large.loaded_spaces()) == [SPACES[k] for k in zoo.ids]  # all held, the least recently used first
    monkeypatch.setenv("ZOO_SPACES_BYTES", "1")
    tiny = zoo.engine()
    got = []
    for adapter_id in order:
        got += _answers(tiny, zoo, [adapter_id])
        assert list(tiny.loaded_spaces()) == [got[-1][0]]  # only the space queried last: the others were dropped
    assert got == expected
    assert all(scores == sorted(scores, reverse=True) for _, _, scores in got)


@pytest.mark.slow
def test_least_recently_used_spaces_are_dropped_first(zoo: Zoo, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, c = (next(iter(zoo.ids[k].values())) for k in ("llama3-8b", "sdxl", "mistral-7b"))
    measured = zoo.engine()
    _answers(measured, zoo, [a, b, c])
    sizes = measured.loaded_spaces()
    assert all(n > 0 for n in sizes.values())
    monkeypatch.setenv("ZOO_SPACES_BYTES", str(sum(sizes.values()) - 1))  # any two of the three fit, not all three
    engine = zoo.engine()
    held = []
    for query in (a, b, c, b, a):
        _answers(engine, zoo, [query])
        held.append(_kinds_held(zoo, engine))
    assert held == [
        ["llama3-8b"],
        ["llama3-8b", "sdxl"],
        ["sdxl", "mistral-7b"],  # llama, used least recently, dropped
        ["mistral-7b", "sdxl"],  # sdxl used again: now the most recent
        ["sdxl", "llama3-8b"],  # mistral dropped, not sdxl
    ]
    assert engine.loaded_spaces() == {SPACES["sdxl"]: sizes[SPACES["sdxl"]], SPACES["llama3-8b"]: sizes[SPACES["llama3-8b"]]}


def _kinds_held(zoo: Zoo, engine: QueryEngine) -> list[str]:
    by_space = {name: kind for kind, name in SPACES.items()}
    return [by_space[name] for name in engine.loaded_spaces()]


@pytest.mark.slow
def test_queries_in_flight_finish_while_other_threads_drop_their_spaces(zoo: Zoo, monkeypatch: pytest.MonkeyPatch) -> None:
    order = _round_robin(zoo)
    expected = dict(zip(order, _answers(zoo.engine(), zoo, order), strict=True))
    monkeypatch.setenv("ZOO_SPACES_BYTES", "1")
    engine = zoo.engine()
    got: dict[int, list] = {}
    failures: list[BaseException] = []

    def ask(queries: list[int]) -> None:
        try:
            for q in queries:
                got.setdefault(q, []).append(_answers(engine, zoo, [q])[0])
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            failures.append(exc)

    threads = [threading.Thread(target=ask, args=(order[i::3] + order[: i + 1],)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    # the same space and hits in the same order; scores equal to float precision (a matrix product's sum may be taken in
    # another order when threads share the BLAS pool: differences of 1e-8 were seen)
    for q, answers in got.items():
        for space, hits, scores in answers:
            assert (space, hits) == expected[q][:2] and scores == pytest.approx(expected[q][2], rel=1e-6, abs=1e-9)
    assert len(engine.loaded_spaces()) == 1


# --- the web app -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(zoo: Zoo):  # type: ignore[no-untyped-def]
    app = create_app({"ZOO_DATABASE_URL": zoo.url, "ZOO_DATA_DIR": str(zoo.data_dir), "TESTING": True})
    return app.test_client()


def _options(html: str, select: str) -> list[tuple[str, str, bool]]:
    """(value, text, selected) of a select's options."""
    body = re.search(rf'<select name="{select}"[^>]*>(.*?)</select>', html, re.S)
    assert body, f"no select {select}"
    return [(v, t.strip(), bool(s)) for v, s, t in re.findall(r'<option value="([^"]*)"\s*(selected)?>([^<]*)</option>', body.group(1))]


def _card_names(html: str) -> list[str]:
    return re.findall(r'<article class="card">\s*<h2><a href="/adapters/\d+">([^<]+)</a>', html)


def test_spaces_resource_says_which_are_loaded_and_their_bytes(zoo: Zoo, client) -> None:  # type: ignore[no-untyped-def]
    client.get(f"/api/v1/adapters/{zoo.ids['llama3-8b']['llama3-8b-f0-m0']}/similar?k=2")
    body = client.get("/api/v1/spaces").json
    spaces = {s["name"]: s for s in body["spaces"]}
    llama = spaces[SPACES["llama3-8b"]]
    assert llama["loaded"] and llama["bytes"] > 4 * 7 * 16 * (4096 + 1024) * 4  # at least its module store's factors
    assert llama["adapters"] == FAMILIES * MEMBERS
    assert body["loaded_bytes"] == sum(s["bytes"] or 0 for s in spaces.values()) and body["budget_bytes"] == 4 << 30
    assert all(s["bytes"] > 0 if s["loaded"] else s["bytes"] is None for s in spaces.values())


def test_search_page_lists_the_spaces_and_keeps_the_pick(zoo: Zoo, client) -> None:  # type: ignore[no-untyped-def]
    html = client.get("/").get_data(as_text=True)
    options = _options(html, "space")
    assert options[0] == ("", "all spaces", True)
    assert {v: t for v, t, _ in options[1:]} == {name: f"{name} ({len(zoo.ids[kind])})" for kind, name in SPACES.items()}
    assert len(_card_names(html)) == 20  # every base's adapters, a page of them

    sdxl = SPACES["sdxl"]
    r = client.get("/", query_string={"space": sdxl, "sort": "name"})
    html = r.get_data(as_text=True)
    assert r.status_code == 200 and ("sd_xl_base_1.0.safetensors", f"{sdxl} (4)", True) in _options(html, "space")
    assert _card_names(html) == sorted(zoo.ids["sdxl"])
    assert "space=sd_xl_base_1.0.safetensors" in re.search(r'rel="alternate" type="application/json" href="([^"]+)"', html).group(1)
    facet = re.search(r'href="([^"]*filter=family[^"]*)"', html)
    assert facet and "space=sd_xl_base_1.0.safetensors" in facet.group(1)  # a facet keeps the space
    twin = client.get("/api/v1/adapters", query_string={"space": sdxl, "sort": "name"}).json
    assert [a["name"] for a in twin["results"]] == sorted(zoo.ids["sdxl"]) and twin["filters"] == {"base_model": sdxl}

    r = client.get("/", query_string={"space": "nope"})
    assert r.status_code == 404 and "no embedding space" in r.get_data(as_text=True)
    r = client.get("/api/v1/adapters", query_string={"space": sdxl, "filter": f"base_model={SPACES['flux1-dev']}"})
    assert r.status_code == 400 and "is not the base model of space" in r.json["error"]["message"]


def test_map_and_similar_pages_pick_the_space(zoo: Zoo, client) -> None:  # type: ignore[no-untyped-def]
    flux = SPACES["flux1-dev"]
    html = client.get("/map", query_string={"space": flux}).get_data(as_text=True)
    assert (flux, f"{flux} (4)", True) in _options(html, "space")
    twin = re.search(r'rel="alternate" type="application/json" href="([^"]+)"', html).group(1)
    assert client.get(twin).json["count"] == 4

    html = client.get("/similar", query_string={"space": flux}).get_data(as_text=True)
    assert _options(html, "space")[0] == ("", "its base model's", False) and (flux, f"{flux} (4)", True) in _options(html, "space")
    path = zoo.root / "src" / "flux1-dev" / "flux1-dev-f0-m1.safetensors"

    def upload(space: str):  # type: ignore[no-untyped-def]
        data = {"file": [(path.open("rb"), path.name)], "space": space, "k": "3"}
        return client.post("/similar", data=data, content_type="multipart/form-data")

    r = upload(flux)  # the diffusers file names no base model: the space says where to look
    html = r.get_data(as_text=True)
    assert r.status_code == 200 and f"similarity in space {flux}" in html
    hits = re.findall(r'<li><a href="/adapters/(\d+)">', html)
    assert hits and {zoo.kind_of(int(i)) for i in hits} == {"flux1-dev"}
    r = upload(SPACES["sdxl"])
    assert r.status_code == 400 and f"does not fit space {SPACES['sdxl']}" in r.get_data(as_text=True)
    assert (SPACES["sdxl"], f"{SPACES['sdxl']} (4)", True) in _options(r.get_data(as_text=True), "space")  # the pick stays


CHROMIUM = Path("/usr/bin/chromium")


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is missing (apt-get install -y chromium)")
def test_picking_a_space_in_the_browser_reloads_the_search_with_it(zoo: Zoo) -> None:
    from playwright.sync_api import sync_playwright

    app = create_app({"ZOO_DATABASE_URL": zoo.url, "ZOO_DATA_DIR": str(zoo.data_dir)})
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM))
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{server.server_port}/?q=f0&semantic=0")  # exact words: only the names that hold f0
            page.select_option("select[name=space]", SPACES["flux1-dev"])
            page.wait_for_url(re.compile(r"space=black-forest-labs%2FFLUX\.1-dev"))
            assert "q=f0" in page.url and "semantic=0" in page.url and page.input_value("select[name=space]") == SPACES["flux1-dev"]
            assert sorted(page.locator("article.card h2 a").all_inner_texts()) == ["flux1-dev-f0-m0", "flux1-dev-f0-m1"]
            browser.close()
    finally:
        server.shutdown()
        thread.join()
