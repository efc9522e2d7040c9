"""Lineage and Hub metadata in search, on both databases, with real PEFT adapters ingested with the `Origin` a Hub
source gives: the base-model tree (stored and recorded descriptions, cycles, depth and width limits), versions,
the adapters of the same base model, author and source; facets, filters and search words from the Hub metadata;
the card's dataset as a label; `zoo lineage`, `zoo show --json`, the API endpoint and the adapter page."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from sqlalchemy import update

from tests.conftest import CLI
from tests.factories import train_peft_adapter
from webapp import create_app
from zoo.config import Settings
from zoo.labels import LabelRow
from zoo.services.ingest import IngestOptions, Ingestor, IngestResult
from zoo.sources import Origin
from zoo.store import lineage as lineage_module
from zoo.store import repository
from zoo.store.blobs import BlobStore
from zoo.store.catalog import search_catalog
from zoo.store.lineage import MAX_DEPTH, MAX_NODES, lineage
from zoo.store.models import Adapter
from zoo.store.session import session_factory

CHAT = "org/chat-7b"


@pytest.fixture(scope="module")
def peft_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Eight distinct real PEFT adapters (a canonical form each)."""
    root = tmp_path_factory.mktemp("lineage-adapters")
    for i in range(8):
        train_peft_adapter(root / f"lora-{i}", seed=i, steps=2)
    return sorted(root.iterdir())


def hub(repo: str, revision: str = "a" * 40, license_: str | None = None, **metadata: Any) -> Origin:
    """What the Hub source says about hf://<repo> (its owner is the author)."""
    return Origin(f"hf://{repo}", revision, repo.split("/")[0], license_, ["lora"], f"# {repo}", metadata)


def store(
    settings: Settings, path: Path, origin: Origin | None = None, base_model: str | None = CHAT, labels: LabelRow | None = None
) -> IngestResult:
    ingestor = Ingestor(session_factory(settings.database_url), BlobStore(settings.blob_dir), IngestOptions(base_model=base_model))
    result = ingestor.ingest(path, labels=labels, origin=origin)
    assert result.status in ("ingested", "duplicate"), result.error
    return result


def stored(settings: Settings, *args: Any, **kwargs: Any) -> int:
    result = store(settings, *args, **kwargs)
    assert result.status == "ingested" and result.adapter_id is not None
    return result.adapter_id


def lineage_of(settings: Settings, adapter_id: int, **kwargs: Any) -> dict[str, Any]:
    with session_factory(settings.database_url)() as session:
        return lineage(session, adapter_id, **kwargs)


def set_columns(settings: Settings, adapter_id: int, **values: Any) -> None:
    """Write columns a Hub source writes (the version link; a rewritten description)."""
    with session_factory(settings.database_url).begin() as session:
        session.execute(update(Adapter).where(Adapter.id == adapter_id).values(**values))


def shape(nodes: list[dict[str, Any]]) -> list[tuple]:
    return [
        (n["model"], n["relation"], n["adapter_id"], n["described_by"], n["cycle"], n["truncated"], shape(n["base_models"])) for n in nodes
    ]


def ids(adapters: list[dict[str, Any]]) -> list[int]:
    return [a["id"] for a in adapters]


def test_the_base_model_tree_climbs_stored_then_recorded_descriptions(settings: Settings, peft_dirs: list[Path]) -> None:
    chat = stored(settings, peft_dirs[0], hub(CHAT, card_base_model=["org/base-7b"], base_model_relation="finetune"), "org/base-7b")
    recorded = {
        "org/base-7b": {"card_base_model": ["org/pretrain"], "base_model_relation": "finetune"},
        CHAT: {"card_base_model": ["ignored/stored-wins"]},
        "org/other-7b": "malformed: not a description",
    }
    lora = stored(
        settings,
        peft_dirs[1],
        hub("alice/lora-a", card_base_model=[CHAT, "org/other-7b", CHAT, 7], base_model_relation="adapter", base_model_tree=recorded),
    )
    found = lineage_of(settings, lora)
    assert found["adapter"]["id"] == lora and found["adapter"]["relation"] == "adapter" and found["adapter"]["author"] == "alice"
    pretrain = ("org/pretrain", "finetune", None, None, False, False, [])
    base = ("org/base-7b", "finetune", None, "recorded", False, False, [pretrain])
    assert shape(found["base_models"]) == [
        (CHAT, "adapter", chat, "stored", False, False, [base]),
        ("org/other-7b", "adapter", None, None, False, False, []),
    ]
    # a newer adapter from hf://org/chat-7b describes it from now on; the files' base model comes first
    newer = stored(settings, peft_dirs[2], hub(CHAT, "b" * 40, card_base_model="org/base-8b", base_model_relation="merge"), "org/x")
    assert shape(lineage_of(settings, lora)["base_models"])[0][:4] == (CHAT, "adapter", newer, "stored")
    assert lineage_of(settings, lora)["base_models"][0]["base_models"][0]["model"] == "org/base-8b"
    assert [n["model"] for n in lineage_of(settings, newer)["base_models"]] == ["org/x", "org/base-8b"]
    # a local adapter: only the base model its files were stored under; none when that is unknown
    local = stored(settings, peft_dirs[3], base_model="tiny")
    assert shape(lineage_of(settings, local)["base_models"]) == [("tiny", None, None, None, False, False, [])]
    unknown = stored(settings, peft_dirs[4], base_model=None)
    found = lineage_of(settings, unknown)
    assert found["base_models"] == [] and found["same_base_model"] == {"value": None, "total": 0, "capped": False, "adapters": []}


def test_cycles_depth_and_width_are_guarded(settings: Settings, peft_dirs: list[Path]) -> None:
    a = stored(settings, peft_dirs[0], hub("x/loop-a", card_base_model=["x/loop-b"], base_model_relation="merge"))
    b = stored(settings, peft_dirs[1], hub("x/loop-b", card_base_model=["x/loop-a"], base_model_relation="merge"))
    assert shape(lineage_of(settings, a)["base_models"])[1] == (
        "x/loop-b",
        "merge",
        b,
        "stored",
        False,
        False,
        [("x/loop-a", "merge", a, "stored", True, False, [])],
    )
    itself = stored(settings, peft_dirs[2], hub("x/self", card_base_model=["x/self"]))
    assert shape(lineage_of(settings, itself)["base_models"])[1] == ("x/self", None, itself, "stored", True, False, [])

    chain = {f"m{i}": {"card_base_model": [f"m{i + 1}"], "base_model_relation": "finetune"} for i in range(3 * MAX_DEPTH)}
    deep = stored(settings, peft_dirs[3], hub("x/deep", card_base_model=["m0"], base_model_tree=chain), base_model="m0")
    node, depth = lineage_of(settings, deep)["base_models"][0], 1
    while node["base_models"]:
        (node,), depth = node["base_models"], depth + 1
    assert depth == MAX_DEPTH and node["model"] == f"m{MAX_DEPTH - 1}" and node["truncated"] and not node["cycle"]

    wide = {"m0": {"card_base_model": [f"w{i}" for i in range(MAX_NODES)]}}
    set_columns(settings, deep, source_metadata={"card_base_model": ["m0"], "base_model_tree": wide})
    (root,) = lineage_of(settings, deep)["base_models"]
    assert root["truncated"] and root["base_models"] == []


def walk(nodes: list[dict[str, Any]], above: tuple[str, ...] = ()) -> Iterator[tuple[dict[str, Any], tuple[str, ...]]]:
    for n in nodes:
        yield n, above
        yield from walk(n["base_models"], (*above, n["model"]))


MODELS = [f"g{i}" for i in range(6)]


@hypothesis_settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    graph=st.dictionaries(st.sampled_from(MODELS), st.lists(st.sampled_from(MODELS), max_size=4)),
    roots=st.lists(st.sampled_from(MODELS), max_size=3),
)
def test_any_recorded_graph_gives_a_finite_faithful_tree(graph_zoo: tuple[Settings, int], graph: dict, roots: list[str]) -> None:
    """Whatever graph a source records (self-loops, cycles, diamonds): a tree within the limits, where every model
    described and not cut off shows exactly its base models, and a model repeats on a path only as a cycle's end."""
    zoo, adapter_id = graph_zoo
    tree = {m: {"card_base_model": parents} for m, parents in graph.items()}
    set_columns(zoo, adapter_id, source_metadata={"card_base_model": roots, "base_model_tree": tree})
    nodes = list(walk(lineage_of(zoo, adapter_id)["base_models"]))
    assert [n["model"] for n, above in nodes if not above] == list(dict.fromkeys(["g0", *roots]))
    assert len(nodes) <= MAX_NODES and all(len(above) < MAX_DEPTH for _, above in nodes)
    for n, above in nodes:
        assert n["cycle"] == (n["model"] in above)
        assert n["described_by"] == ("recorded" if n["model"] in graph else None)
        if n["described_by"] and not n["cycle"] and not n["truncated"]:
            assert [c["model"] for c in n["base_models"]] == list(dict.fromkeys(graph[n["model"]]))
        else:
            assert n["base_models"] == []


@pytest.fixture
def graph_zoo(settings: Settings, peft_dirs: list[Path]) -> tuple[Settings, int]:
    """One adapter stored under base model g0, its description rewritten by each example."""
    return settings, stored(settings, peft_dirs[0], hub("y/graph"), base_model="g0")


def test_versions_follow_the_links_both_ways(settings: Settings, peft_dirs: list[Path]) -> None:
    v1, v2, v3 = (
        stored(settings, peft_dirs[i], hub("alice/lora-v", str(i + 1) * 40, last_modified=f"2026-0{i + 1}-01T00:00:00Z")) for i in range(3)
    )
    other = stored(settings, peft_dirs[3], hub("alice/lora-w"))
    set_columns(settings, v2, previous_version_id=v1)
    set_columns(settings, v3, previous_version_id=v2)
    mid = lineage_of(settings, v2)["versions"]
    assert ids(mid["older"]) == [v1] and ids(mid["newer"]) == [v3]
    assert mid["older"][0]["source_revision"] == "1" * 40 and mid["newer"][0]["last_modified"] == "2026-03-01T00:00:00Z"
    assert mid["older"][0]["created_at"]
    assert ids(lineage_of(settings, v1)["versions"]["newer"]) == [v2, v3]
    assert ids(lineage_of(settings, v3)["versions"]["older"]) == [v2, v1]
    assert lineage_of(settings, other)["versions"] == {"older": [], "newer": []}
    assert ids(lineage_of(settings, v3, limit=1)["versions"]["older"]) == [v2]
    same = lineage_of(settings, v2)["same_source"]
    assert same["value"] == "hf://alice/lora-v" and same["total"] == 2 and ids(same["adapters"]) == [v3, v1]
    set_columns(settings, v1, previous_version_id=v3)  # a cycle ends the walk instead of looping
    assert ids(lineage_of(settings, v1)["versions"]["older"]) == [v3, v2]
    assert ids(lineage_of(settings, v2)["versions"]["newer"]) == [v3, v1]


def test_same_base_author_and_source_are_limited_and_counted(
    settings: Settings, peft_dirs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    alice = [stored(settings, peft_dirs[i], hub(f"alice/lora-{i}")) for i in range(3)]
    bob = [stored(settings, peft_dirs[i], hub(f"bob/lora-{i}")) for i in range(3, 5)]
    elsewhere = stored(settings, peft_dirs[5], hub("alice/sd-lora"), base_model="sd-v1-5")
    local = stored(settings, peft_dirs[6])
    found = lineage_of(settings, alice[0], limit=2)
    same_author = found["same_author"]
    assert (same_author["value"], same_author["total"], same_author["capped"]) == ("alice", 3, False)
    assert ids(same_author["adapters"]) == [elsewhere, alice[2]]  # the newest first, the limit kept
    assert ids(lineage_of(settings, alice[0])["same_author"]["adapters"]) == [elsewhere, alice[2], alice[1]]  # never itself
    assert found["same_base_model"]["total"] == 5 and ids(found["same_base_model"]["adapters"]) == [local, bob[1]]
    assert found["same_source"]["total"] == 0 and found["limit"] == 2
    assert {a["author"] for a in lineage_of(settings, bob[0])["same_author"]["adapters"]} == {"bob"}
    assert lineage_of(settings, local)["same_author"] == {"value": None, "total": 0, "capped": False, "adapters": []}
    monkeypatch.setattr(lineage_module, "COUNT_CAP", 4)
    capped = lineage_of(settings, alice[0])["same_base_model"]
    assert capped["total"] == 4 and capped["capped"] and len(capped["adapters"]) == 5
    monkeypatch.setattr(lineage_module, "COUNT_CAP", 5)
    assert lineage_of(settings, alice[0])["same_base_model"] | {"adapters": []} == {
        "value": CHAT,
        "total": 5,
        "capped": False,
        "adapters": [],
    }


@pytest.fixture
def hub_zoo(settings: Settings, peft_dirs: list[Path]) -> dict[str, int]:
    """Three Hub adapters with their metadata and a local one: {name: id}."""
    meta = {"library_name": "peft", "base_model_relation": "adapter", "card_base_model": [CHAT]}
    return {
        "imdb": stored(
            settings, peft_dirs[0], hub("alice/imdb", license_="mit", datasets=["imdb"], pipeline_tag="text-classification", **meta)
        ),
        "chat": stored(
            settings,
            peft_dirs[1],
            hub("alice/chat", license_="apache-2.0", datasets=["ultrachat", "oasst1"], pipeline_tag="text-generation", **meta),
        ),
        "code": stored(
            settings, peft_dirs[2], hub("bob/code", license_="mit", pipeline_tag="text-generation", base_model_relation="finetune")
        ),
        "local": stored(settings, peft_dirs[3]),
    }


def test_hub_metadata_makes_facets_filters_and_search_words(
    settings: Settings, hub_zoo: dict[str, int], peft_dirs: list[Path], cli: CLI
) -> None:
    with session_factory(settings.database_url)() as session:
        found = search_catalog(session, None, {})
        facets = {k: {v["value"]: v["count"] for v in values} for k, values in found["facets"].items()}
        assert facets["author"] == {"alice": 2, "bob": 1} and facets["license"] == {"mit": 2, "apache-2.0": 1}
        assert facets["pipeline_tag"] == {"text-generation": 2, "text-classification": 1} and facets["library"] == {"peft": 2}
        assert facets["base_model_relation"] == {"adapter": 2, "finetune": 1}
        assert list(found["facets"])[4:9] == ["author", "license", "pipeline_tag", "library", "base_model_relation"]
        # a facet counts what its own filter's alternatives keep; the others narrow to the filter
        alice = search_catalog(session, None, {"author": "alice"})
        assert alice["total"] == 2 and {v["value"] for v in alice["facets"]["author"]} == {"alice", "bob"}
        assert {v["value"]: v["count"] for v in alice["facets"]["license"]} == {"mit": 1, "apache-2.0": 1}
        assert search_catalog(session, None, {"pipeline_tag": "text-generation", "license": "mit"})["results"][0]["id"] == hub_zoo["code"]
        assert search_catalog(session, None, {"library": "peft", "base_model_relation": "finetune"})["total"] == 0
        local = search_catalog(session, None, {"source": str(peft_dirs[3])})  # the source's facets where present only
        assert local["total"] == 1 and not {"author", "license", "pipeline_tag", "library", "base_model_relation"} & set(local["facets"])
        # the search document: author, every dataset, the pipeline tag
        for q, names in (
            ("oasst1", {"chat"}),
            ("imdb", {"imdb"}),
            ("author=bob", {"code"}),
            ("alice", {"imdb", "chat"}),
            ("text-generation", {"chat", "code"}),
            ("pipeline_tag=text-classification", {"imdb"}),
            ("dataset=ultrachat", {"chat"}),
        ):
            assert {r["id"] for r in search_catalog(session, q, {})["results"]} == {hub_zoo[n] for n in names}, q
        # the engine's filters read the same columns
        assert repository.filter_adapter_ids(session, CHAT, {"author": "alice"}) == sorted([hub_zoo["imdb"], hub_zoo["chat"]])
        assert repository.filter_adapter_ids(session, CHAT, {"dataset": "imdb", "license": "mit"}) == [hub_zoo["imdb"]]
    rc, (listed,) = cli.json_lines("list", "--filter", "author=alice", "--query", "imdb")
    assert rc == 0 and [r["id"] for r in listed["results"]] == [hub_zoo["imdb"]] and listed["results"][0]["author"] == "alice"


def test_a_card_naming_one_dataset_gives_the_dataset_label(settings: Settings, hub_zoo: dict[str, int], peft_dirs: list[Path]) -> None:
    def labels(adapter_id: int) -> dict[str, str]:
        with session_factory(settings.database_url)() as session:
            adapter = repository.get_adapter(session, adapter_id)
            assert adapter is not None
            return dict(repository.adapter_detail(adapter)["labels"])  # type: ignore[arg-type]

    assert labels(hub_zoo["imdb"]) == {"dataset": "imdb"}
    assert labels(hub_zoo["chat"]) == {} and labels(hub_zoo["code"]) == {}  # two datasets, or none: no label
    given = LabelRow({"dataset": "my-imdb-split", "task": "sentiment"})
    mine = stored(settings, peft_dirs[4], hub("carol/a", datasets=["imdb"]), labels=given)
    assert labels(mine) == {"dataset": "my-imdb-split", "task": "sentiment"}  # the user's label wins
    other = stored(settings, peft_dirs[5], hub("carol/b", datasets=[" sst2 ", "sst2", None]), labels=LabelRow({"task": "sentiment"}))
    assert labels(other) == {"dataset": "sst2", "task": "sentiment"}
    again = store(settings, peft_dirs[0], hub("mallory/copy", datasets=["something-else"]))
    assert again.status == "duplicate" and labels(hub_zoo["imdb"]) == {"dataset": "imdb"}  # never over a stored adapter's


def test_zoo_show_and_zoo_lineage(settings: Settings, hub_zoo: dict[str, int], cli: CLI) -> None:
    imdb = hub_zoo["imdb"]
    rc, (shown,) = cli.json_lines("show", str(imdb))
    assert rc == 0 and shown["author"] == "alice" and shown["source_revision"] == "a" * 40 and shown["previous_version_id"] is None
    assert shown["source_metadata"]["datasets"] == ["imdb"] and shown["source_metadata"]["pipeline_tag"] == "text-classification"
    rc, (found,) = cli.json_lines("lineage", str(imdb))
    assert rc == 0 and found == json.loads(json.dumps(lineage_of(settings, imdb)))
    rc, out, _ = cli("lineage", str(imdb))
    lines = out.splitlines()
    assert rc == 0 and lines[0].startswith(f"#{imdb} lora-0  by alice  @ aaaaaaaaaaaa") and "  └─ adapter of org/chat-7b" in lines
    assert f"same base model {CHAT}: 3 others" in lines and f"  #{hub_zoo['code']} lora-2  by bob  @ aaaaaaaaaaaa" in lines
    assert "same author alice: 1 other" in lines
    rc, _, err = cli("lineage", "999")
    assert rc != 0 and "no adapter with id 999" in err


def test_the_api_endpoint_and_the_adapter_page(settings: Settings, hub_zoo: dict[str, int]) -> None:
    app = create_app({"ZOO_DATABASE_URL": settings.database_url, "ZOO_DATA_DIR": str(settings.data_dir), "TESTING": True})
    client = app.test_client()
    imdb, chat = hub_zoo["imdb"], hub_zoo["chat"]
    r = client.get(f"/api/v1/adapters/{imdb}/lineage")
    assert r.status_code == 200 and r.json == json.loads(json.dumps(lineage_of(settings, imdb)))
    assert client.get(f"/api/v1/adapters/{imdb}").json["lineage"] == r.json  # the page's JSON twin holds it
    missing = client.get("/api/v1/adapters/999/lineage")
    assert missing.status_code == 404 and missing.json == {
        "error": {"status": 404, "type": "not_found", "message": "no adapter with id 999", "detail": None}
    }
    assert "/api/v1/adapters/{adapter_id}/lineage" in client.get("/api/v1/openapi.json").json["paths"]
    page = client.get(f"/adapters/{imdb}").get_data(as_text=True)
    section = page[page.index('<section class="lineage">') :].split("</section>")[0]
    assert "<h2>Lineage</h2>" in section and f'href="/adapters/{chat}"' in section and f'href="/adapters/{hub_zoo["code"]}"' in section
    assert "adapter of</span>" in section and "/?filter=base_model%3Dorg/chat-7b" in section
    search = client.get("/?filter=author%3Dalice").get_data(as_text=True)
    assert (
        f'href="/adapters/{imdb}"' in search and f'href="/adapters/{hub_zoo["code"]}"' not in search and "<h3>pipeline tag</h3>" in search
    )
