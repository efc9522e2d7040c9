"""Catalog search (zoo/store/catalog.py) on both databases: full-text words, phrases and prefixes over
names, labels, cards and sources; hostile text; facets against counts made in Python; pages; sorts;
the search document kept in step with labels and deletes; migration 0005's backfill and downgrade."""

from __future__ import annotations

import random
import uuid
from collections import Counter
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from sqlalchemy import inspect, select, text

from tests.conftest import CLI
from tests.factories import train_peft_adapter, write_kohya_file
from zoo.errors import UsageError
from zoo.store import catalog as catalog_module
from zoo.store import repository
from zoo.store.catalog import FACET_VALUES, MAX_PER_PAGE, search_catalog
from zoo.store.models import Adapter, AdapterText, Label
from zoo.store.search_text import refresh_search_text
from zoo.store.session import downgrade, make_engine, session_factory, upgrade

HOSTILE = [
    '"',
    '""',
    "*",
    "a*",
    "AND",
    "OR NOT",
    "NEAR(",
    "NEAR(a b, 2)",
    "-x",
    "x -y",
    "'; drop table adapter; --",
    "digits:*",
    "a & b | !c <-> d",
    "(((",
    "^start",
    "col:value",
    "{a b}",
    "😀",
    "🚀 lora 🚀",
    "\x00",
    "\\",
    "Ünïcödé ßtraße İstanbul",
    "ﬁne-tuned ｆｕｌｌｗｉｄｔｈ",
    "日本語のテキスト",
    " \t\n ",
    "x" * 5000,
    "word " * 2000,
]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real adapters: three PEFT directories (one nested) and a kohya file, and a labels CSV beside them."""
    root = tmp_path_factory.mktemp("catalog")
    train_peft_adapter(root / "zoo" / "digits-vit-00012", seed=0)
    train_peft_adapter(root / "zoo" / "digits-vit-00013", seed=1)
    train_peft_adapter(root / "zoo" / "nested" / "probe-anime", seed=2)
    write_kohya_file(root / "style-watercolor.safetensors", seed=3)
    (root / "labels.csv").write_text(
        "name,task,dataset\n"
        "digits-vit-00012,even,digits\n"
        "digits-vit-00013,odd,digits\n"
        "nested/probe-anime,odd,anime-faces\n"
        "style-watercolor,style,paintings\n"
    )
    return root


@pytest.fixture
def ingested(cli: CLI, sources: Path) -> dict[str, int]:
    """The real adapters ingested with their labels: {name: adapter id}."""
    ids: dict[str, int] = {}
    for path, base in ((sources / "zoo", "tiny-lm"), (sources / "style-watercolor.safetensors", "sd-v1-5")):
        rc, results = cli.json_lines("ingest", "--no-embed", str(path), "--base-model", base, "--labels", str(sources / "labels.csv"))
        assert rc == 0, results
        ids.update({r["name"]: r["adapter_id"] for r in results})
    return ids


def add_adapters(url: str, specs: list[dict[str, Any]]) -> list[int]:
    """Adapter rows (and given labels) inserted with the ORM, with their search documents; only text matters."""
    with session_factory(url)() as s, s.begin():
        rows = []
        for spec in specs:
            spec = dict(spec)
            labels = spec.pop("labels", {})
            rows.append(
                Adapter(
                    source_uri=spec.pop("source_uri", f"/zoos/synthetic/{spec['name']}"),
                    base_model=spec.pop("base_model", "tiny"),
                    format=spec.pop("format", "peft"),
                    canonical_hash=uuid.uuid4().hex * 2,
                    structure_hash="0" * 64,
                    file_sha256="0" * 64,
                    size_bytes=1,
                    labels=[Label(key=k, value=v) for k, v in labels.items()],
                    **spec,
                )
            )
        s.add_all(rows)
        s.flush()
        refresh_search_text(s, [a.id for a in rows])
        return [a.id for a in rows]


def catalog(url: str, q: str | None, filters: Mapping[str, str] | None = None, *args: Any, **kw: Any) -> dict[str, Any]:
    """search_catalog in a session of its own (a SQLite reader keeps the snapshot it began with)."""
    with session_factory(url)() as session:
        return search_catalog(session, q, filters or {}, *args, **kw)


def found_names(url: str, q: str | None, filters: Mapping[str, str] | None = None, **kw: Any) -> set[str]:
    return {r["name"] for r in catalog(url, q, filters, per_page=MAX_PER_PAGE, **kw)["results"]}


def test_words_phrases_and_prefixes_find_the_right_adapters(ingested: dict[str, int], db_url: str) -> None:
    digits = {"digits-vit-00012", "digits-vit-00013"}
    assert found_names(db_url, "digits-vit-00012") == {"digits-vit-00012"}
    assert found_names(db_url, "digits-vit-0001") == digits  # the last word is a prefix
    assert found_names(db_url, "vit digits") == digits  # words are AND-ed in any order
    assert found_names(db_url, "DIGI") == digits
    assert found_names(db_url, "digits 00013") == {"digits-vit-00013"}
    assert found_names(db_url, "vit-digits") == set()  # a punctuated word is a phrase
    assert found_names(db_url, "task=even") == {"digits-vit-00012"}  # a label, key and value
    assert found_names(db_url, "task:odd") == {"digits-vit-00013", "probe-anime"}
    assert found_names(db_url, "anime-faces") == {"probe-anime"}  # a label value with a hyphen
    assert found_names(db_url, "paintings") == {"style-watercolor"}
    assert found_names(db_url, "tiny-lm") == {*digits, "probe-anime"}  # the base model
    assert found_names(db_url, "sd-v1-5 kohya") == {"style-watercolor"}  # base model and format
    assert found_names(db_url, "nested") == {"probe-anime"}  # the source URI's directories
    assert found_names(db_url, "digits odd") == {"digits-vit-00013"}
    assert found_names(db_url, "digits watercolor") == set()


def test_results_carry_labels_tags_and_summary(ingested: dict[str, int], db_url: str) -> None:
    (hit,) = catalog(db_url, "task=even", {})["results"]
    assert hit["id"] == ingested["digits-vit-00012"] and hit["labels"] == {"task": "even", "dataset": "digits"}
    assert hit["tags"] == [] and hit["base_model"] == "tiny-lm" and hit["format"] == "peft" and hit["rank"] == 4
    assert {"canonical_hash", "source_uri", "created_at"} <= set(hit)


def test_card_text_tags_and_unicode_are_searchable(db_url: str) -> None:
    add_adapters(
        db_url,
        [
            {"name": "reviews", "card": "Fine-tuned on CAFÉ reviews from Zürich 🚀 (see https://example.org/data?id=7).", "tags": ["sdxl"]},
            {"name": "plain", "card": None, "tags": ["photoreal", 42]},
        ],
    )
    assert found_names(db_url, "cafe") == {"reviews"}  # accents and case folded
    assert found_names(db_url, "Café zurich") == {"reviews"}
    assert found_names(db_url, "example.org") == {"reviews"}
    assert found_names(db_url, "🚀 fine-tuned") == {"reviews"}  # symbols are not words
    assert found_names(db_url, "sdxl") == {"reviews"}
    assert found_names(db_url, "photo") == {"plain"}
    assert found_names(db_url, "42") == {"plain"}


def test_label_edits_are_reflected(ingested: dict[str, int], db_url: str, cli: CLI, sources: Path, tmp_path: Path) -> None:
    assert found_names(db_url, "task=even") == {"digits-vit-00012"}
    relabel = tmp_path / "relabel.csv"
    relabel.write_text("name,task,style\ndigits-vit-00012,prime,pixel-art\n")
    rc, (result,) = cli.json_lines(
        "ingest", "--no-embed", str(sources / "zoo" / "digits-vit-00012"), "--base-model", "tiny-lm", "--labels", str(relabel)
    )
    assert rc == 0 and result["status"] == "duplicate" and result["adapter_id"] == ingested["digits-vit-00012"]
    assert found_names(db_url, "task=even") == set()
    assert found_names(db_url, "task=prime") == {"digits-vit-00012"}
    assert found_names(db_url, "pixel-art") == {"digits-vit-00012"}
    assert found_names(db_url, "digits task=prime") == {"digits-vit-00012"}  # labels not in the CSV stay


@pytest.mark.parametrize("q", HOSTILE)
def test_hostile_text_never_raises(db_url: str, q: str) -> None:
    add_adapters(db_url, [{"name": "digits-vit-00012", "labels": {"task": "even"}}, {"name": "and-near-x", "card": "AND NEAR x"}])
    for sort in (None, "relevance", "name"):
        found = catalog(db_url, q, {}, sort)
        assert found["q"] == q and found["total"] == len(found["results"]) <= 2


def test_ten_kilobytes_of_text(db_url: str) -> None:
    card = " ".join(f"word{i} ünïcode-{i} 😀" for i in range(700))[:10_000]
    add_adapters(db_url, [{"name": "long", "card": card}])
    assert found_names(db_url, card) == {"long"}  # the first 32 words, AND-ed
    assert found_names(db_url, "word699") == set()  # past the 10 KB cut
    assert found_names(db_url, "word420") == {"long"}


def synthetic_zoo(url: str, n: int = 57, seed: int = 0) -> list[dict[str, Any]]:
    """n adapters with varied columns, labels, sources and creation times; returns their specs."""
    rng = random.Random(seed)
    start = datetime(2020, 1, 1, tzinfo=UTC)
    specs = []
    for i in range(n):
        labels = {"task": rng.choice(["even", "odd", "rot90", "noise"]), "seed": str(i % 7)}
        if i % 3:
            labels["style"] = rng.choice(["anime", "pixel art", "ink"])
        directory = rng.choice(["/zoos/a/", "/zoos/a/deep/", "/zoos/b/", "hf://org/"])
        word = rng.choice(["alpha", "beta", "gamma"])
        specs.append(
            {
                "name": f"{word}-{i:03d}",
                "base_model": rng.choice(["tiny", "vit-b", "sd-v1-5"]),
                "format": rng.choice(["peft", "kohya"]),
                "rank": rng.choice([4, 8, 16, None]),
                "source_uri": f"{directory}{word}-{i:03d}",
                "created_at": start + timedelta(minutes=rng.randrange(10_000)),
                "labels": labels,
            }
        )
    add_adapters(url, specs)
    return specs


def matches(spec: Mapping[str, Any], q: str | None, filters: Mapping[str, str]) -> bool:
    """What the catalog should keep, computed in Python: q is one word of the names."""
    for key, value in filters.items():
        if key == "source":
            if not spec["source_uri"].startswith(value):
                return False
        elif key in ("base_model", "format", "rank"):
            if str(spec[key]) != value:
                return False
        elif spec["labels"].get(key) != value:
            return False
    return q is None or spec["name"].startswith(q + "-")


def expected_facets(specs: list[dict[str, Any]], q: str | None, filters: dict[str, str]) -> dict[str, dict[Any, int]]:
    """Each facet's counts over the specs matching q and every filter but the facet's own."""

    def kept(key: str) -> list[dict[str, Any]]:
        return [s for s in specs if matches(s, q, {k: v for k, v in filters.items() if k != key})]

    out: dict[str, dict[Any, int]] = {
        key: dict(Counter(s[key] for s in kept(key) if s[key] is not None)) for key in ("base_model", "format", "rank")
    }
    in_source = kept("source")
    directories = {s["source_uri"].rsplit("/", 1)[0] + "/" for s in in_source}
    out["source"] = {d: sum(s["source_uri"].startswith(d) for s in in_source) for d in directories}
    for key in {k for s in specs for k in s["labels"]}:
        counts = Counter(s["labels"][key] for s in kept(key) if key in s["labels"])
        if counts:
            out[f"label:{key}"] = dict(counts)
    return out


@pytest.mark.parametrize(
    ("q", "filters"),
    [
        (None, {}),
        ("alpha", {}),
        ("beta", {"task": "odd"}),
        (None, {"base_model": "tiny", "style": "pixel art"}),
        ("gamma", {"format": "kohya", "rank": "8", "source": "/zoos/a/"}),
        (None, {"source": "/zoos/", "seed": "3", "task": "noise"}),
    ],
)
def test_facet_counts_equal_counts_made_in_python(db_url: str, q: str | None, filters: dict[str, str]) -> None:
    specs = synthetic_zoo(db_url)
    found = catalog(db_url, q, filters, per_page=MAX_PER_PAGE)
    assert found["total"] == sum(matches(s, q, filters) for s in specs) == len(found["results"])
    got = {key: {v["value"]: v["count"] for v in values} for key, values in found["facets"].items() if values}
    assert got == expected_facets(specs, q, filters)
    assert list(found["facets"])[:4] == ["base_model", "format", "rank", "source"]
    for values in found["facets"].values():
        assert [v["count"] for v in values] == sorted((v["count"] for v in values), reverse=True)
    for key in filters:  # a facet value's count is what choosing it keeps
        facet = f"label:{key}" if key not in ("base_model", "format", "rank", "source") else key
        for v in found["facets"][facet]:
            assert catalog(db_url, q, {**filters, key: str(v["value"])})["total"] == v["count"]


@pytest.mark.parametrize("read_cost", [0, 10**9])  # on PostgreSQL: through the two narrowest filters; the three narrowest
@pytest.mark.parametrize(
    "filters",
    [
        {"base_model": "tiny", "format": "peft", "style": "pixel art"},
        {"source": "/zoos/a/", "task": "odd", "style": "ink", "format": "kohya"},
        {"source": "/zoos/", "base_model": "sd-v1-5", "format": "peft", "task": "even", "seed": "2"},
        {"task": "noise", "seed": "4", "style": "anime"},
    ],
)
def test_facets_of_many_filters_are_exact_whichever_filters_the_candidates_come_through(
    db_url: str, filters: dict[str, str], read_cost: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The facets' candidates (the adapters missing at most one filter) are read through two or three of the filters
    (zoo/store/catalog.py, _candidate_filters, by the cost of reading candidates by id): either way every count is the one
    made in Python."""
    monkeypatch.setattr(catalog_module, "CANDIDATE_READ_COST", read_cost)
    specs = synthetic_zoo(db_url, n=120, seed=3)
    found = catalog(db_url, None, filters, per_page=MAX_PER_PAGE)
    assert found["total"] == sum(matches(s, None, filters) for s in specs)
    got = {key: {v["value"]: v["count"] for v in values} for key, values in found["facets"].items() if values}
    assert got == {key: counts for key, counts in expected_facets(specs, None, filters).items() if counts}


def test_facets_keep_the_most_frequent_values(db_url: str) -> None:
    add_adapters(db_url, [{"name": f"n{i}", "labels": {"seed": str(i), "task": "t"}} for i in range(FACET_VALUES + 10)])
    facets = catalog(db_url, None, {})["facets"]
    assert len(facets["label:seed"]) == FACET_VALUES and facets["label:task"] == [{"value": "t", "count": FACET_VALUES + 10}]


@pytest.mark.parametrize("sort", ["relevance", "name", "newest", "rank"])
@pytest.mark.parametrize(("q", "filters"), [(None, {}), ("alpha", {}), (None, {"task": "odd"})])
def test_pages_cover_every_match_exactly_once(db_url: str, sort: str, q: str | None, filters: dict[str, str]) -> None:
    specs = synthetic_zoo(db_url)
    expected = {s["name"] for s in specs if matches(s, q, filters)}
    seen: list[str] = []
    for page in range(1, 20):
        found = catalog(db_url, q, filters, sort, page, per_page=7)
        assert found["total"] == len(expected) and found["page"] == page and found["per_page"] == 7
        if not found["results"]:
            break
        seen += [r["name"] for r in found["results"]]
    assert sorted(seen) == sorted(expected) and len(seen) == len(set(seen))
    assert page == -(-len(expected) // 7) + 1


def test_sorts_are_ordered(db_url: str) -> None:
    specs = synthetic_zoo(db_url)
    add_adapters(db_url, [{"name": "Zeta-upper", "rank": 2}, {"name": "ämlaut", "rank": 64}])
    by_name = catalog(db_url, None, {}, "name", per_page=MAX_PER_PAGE)["results"]
    assert [r["name"] for r in by_name] == sorted(r["name"] for r in by_name)  # code point order
    newest = catalog(db_url, None, {}, "newest", per_page=MAX_PER_PAGE)["results"]
    created = {s["name"]: s["created_at"] for s in specs}
    times = [created[r["name"]] for r in newest if r["name"] in created]
    assert times == sorted(times, reverse=True) and {r["name"] for r in newest[:2]} == {"Zeta-upper", "ämlaut"}  # inserted now
    ranks = [r["rank"] for r in catalog(db_url, None, {}, "rank", per_page=MAX_PER_PAGE)["results"]]
    known = [r for r in ranks if r is not None]
    assert known == sorted(known) and ranks[: len(known)] == known and ranks[0] == 2


def test_relevance_puts_the_best_match_first(db_url: str) -> None:
    add_adapters(
        db_url,
        [
            {"name": "once", "card": "a model card that mentions watercolor once " + "among many other words " * 20},
            {"name": "watercolor-watercolor", "labels": {"style": "watercolor"}, "card": "watercolor"},
            {"name": "none", "card": "oil"},
        ],
    )
    found = catalog(db_url, "watercolor", {})
    assert found["sort"] == "relevance" and [r["name"] for r in found["results"]] == ["watercolor-watercolor", "once"]
    assert catalog(db_url, None, {}, "relevance")["sort"] == "newest"  # no words: nothing to rank by


def test_bad_requests_are_usage_errors(db_url: str) -> None:
    for kwargs in ({"per_page": MAX_PER_PAGE + 1}, {"per_page": 0}, {"page": 0}, {"sort": "popular"}):
        with pytest.raises(UsageError):
            catalog(db_url, "x", {}, **kwargs)
    with pytest.raises(UsageError, match="whole number"):
        catalog(db_url, None, {"rank": "four"})
    assert catalog(db_url, None, {}, page=1000)["results"] == []


def test_deleting_an_adapter_removes_its_document(db_url: str) -> None:
    keep, gone = add_adapters(db_url, [{"name": "keep-me", "card": "shared"}, {"name": "drop-me", "card": "shared"}])
    with session_factory(db_url)() as s, s.begin():
        s.delete(s.get(Adapter, gone))
    assert found_names(db_url, "shared") == {"keep-me"}
    with make_engine(db_url).connect() as conn:
        assert conn.scalars(select(AdapterText.adapter_id)).all() == [keep]
        if conn.dialect.name == "sqlite":  # the FTS5 index dropped it too, and agrees with its table
            assert conn.execute(text("SELECT rowid FROM adapter_text_fts WHERE adapter_text_fts MATCH 'drop'")).all() == []
            conn.execute(text("INSERT INTO adapter_text_fts(adapter_text_fts) VALUES ('integrity-check')"))


def test_migration_backfills_existing_adapters_and_downgrades(db_url: str) -> None:
    downgrade(db_url, "0004")
    assert "adapter_text" not in inspect(make_engine(db_url)).get_table_names()
    with make_engine(db_url).begin() as conn:  # the columns of schema 0004 only (the models are at the head)
        conn.execute(
            text(
                "INSERT INTO adapter (id, name, source_uri, base_model, format, canonical_hash, structure_hash, file_sha256, size_bytes, "
                "config, file_metadata, extra_tensors, notes) VALUES (1, 'old-adapter', '/zoos/old/old-adapter', 'tiny', 'peft', "
                ":h1, :h0, :h0, 1, '{}', '{}', '{}', '[]')"
            ),
            {"h1": "1" * 64, "h0": "0" * 64},
        )
        conn.execute(text("INSERT INTO label (adapter_id, key, value, source) VALUES (1, 'task', 'legacy-task', 'given')"))
    upgrade(db_url)
    assert found_names(db_url, "task=legacy-task") == {"old-adapter"}
    assert catalog(db_url, "old")["facets"]["label:task"] == [{"value": "legacy-task", "count": 1}]
    downgrade(db_url, "0004")
    names = set(inspect(make_engine(db_url)).get_table_names())
    assert "adapter_text" not in names and not any(n.startswith("adapter_text_fts") for n in names)
    if db_url.startswith("sqlite"):
        with make_engine(db_url).connect() as conn:
            assert conn.execute(text("SELECT name FROM sqlite_master WHERE type = 'trigger'")).all() == []
    upgrade(db_url)
    assert found_names(db_url, "legacy") == {"old-adapter"}


def test_zoo_list_uses_the_catalog(ingested: dict[str, int], cli: CLI) -> None:
    rc, (found,) = cli.json_lines("list", "--query", "digits", "--filter", "task=odd", "--sort", "name")
    assert rc == 0 and found["total"] == 1 and found["results"][0]["name"] == "digits-vit-00013"
    assert found["facets"]["label:task"] == [{"value": "even", "count": 1}, {"value": "odd", "count": 1}]
    rc, out, _ = cli("list", "--per-page", "2", "--sort", "name")
    assert rc == 0 and "digits-vit-00012" in out and "page 1 of 2 (4 adapters, sorted by name)" in out
    rc, out, _ = cli("list", "-q", "nothing-like-this")
    assert rc == 0 and "no adapters match" in out
    rc, _, err = cli("list", "--per-page", str(MAX_PER_PAGE + 1))
    assert rc == 2 and "per_page" in err


@hypothesis_settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    q=st.text(max_size=80)
    | st.lists(st.sampled_from(["alpha", "-", '"', "*", "AND", "NEAR(", "task=odd", "é", "00", " "]), max_size=8).map("".join),
    filters=st.sampled_from(
        [{}, {"task": "odd"}, {"rank": "8", "style": "ink"}, {"source": "/zoos/a/"}, {"format": "kohya", "task": "even"}]
    ),
    sort=st.sampled_from([None, "relevance", "name", "newest", "rank"]),
)
def test_any_text_never_raises_and_stays_within_the_filters(synthetic: str, q: str, filters: dict[str, str], sort: str | None) -> None:
    with session_factory(synthetic)() as session:
        found = search_catalog(session, q, filters, sort, per_page=MAX_PER_PAGE)
        allowed = {i for base in ("tiny", "vit-b", "sd-v1-5") for i in repository.filter_adapter_ids(session, base, filters)}
    ids = [r["id"] for r in found["results"]]
    assert set(ids) <= allowed and len(ids) == len(set(ids)) == found["total"]


@pytest.fixture
def synthetic(db_url: str) -> str:
    """A database holding synthetic_zoo's adapters."""
    synthetic_zoo(db_url)
    return db_url
