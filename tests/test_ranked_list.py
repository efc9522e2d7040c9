"""The bounded parts of a search by meaning: full text's list ranks at most RANKED_LIST_ROWS matches in one statement,
and the facets of a ranked list are those of its adapters, on both databases."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.orm import Session

from tests.test_catalog import catalog, synthetic_zoo
from zoo.limits import MAX_PER_PAGE
from zoo.store import catalog as cat
from zoo.store.session import make_engine, session_factory


def test_full_text_list_is_the_catalog_ranking_up_to_its_cap(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    synthetic_zoo(db_url)
    ranked = catalog(db_url, "alpha", {}, "relevance", per_page=MAX_PER_PAGE)
    expected = [r["id"] for r in ranked["results"]]
    assert len(expected) > 5
    with session_factory(db_url)() as session:
        assert cat.ranked_ids(session, "alpha", {}, 100) == expected
        assert cat.ranked_ids(session, "alpha", {}, 3) == expected[:3]
        monkeypatch.setattr(cat, "RANKED_LIST_ROWS", 4)  # ranks 4 of the matches, whichever the index gives first
        capped = cat.ranked_ids(session, "alpha", {}, 100)
    assert len(capped) == 4 and set(capped) <= set(expected)


def test_facets_of_a_list_count_its_adapters(db_url: str) -> None:
    synthetic_zoo(db_url)
    page = catalog(db_url, "beta", {}, per_page=MAX_PER_PAGE)
    ids = [r["id"] for r in page["results"]]
    with session_factory(db_url)() as session:
        facets = cat.facets_of(session, ids)
        again = cat.facets_of(session, ids[:2])
    assert facets == page["facets"]
    assert sum(v["count"] for v in again["base_model"]) == 2


def _plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _plan_nodes(child)


def test_a_short_prefix_is_not_searched_when_another_word_is_in_no_document(db_url: str) -> None:
    synthetic_zoo(db_url)
    # the last word a prefix of at most SHORT_PREFIX_CHARS: the other words looked up first, on PostgreSQL; the same ranking
    found = {}
    for q in ("alpha odd 0", "beta task 1", "alpha film 1", "film 1", "gamma 0", "pixel art 2", "anime noise 0"):
        expected = [r["id"] for r in catalog(db_url, q, {}, "relevance", per_page=MAX_PER_PAGE)["results"]]
        with session_factory(db_url)() as session:
            found[q] = cat.ranked_ids(session, q, {}, 100)
        assert found[q] == expected, q
    assert found["alpha odd 0"] and found["gamma 0"] and not found["alpha film 1"]
    statements: list[tuple[str, Any]] = []
    engine = make_engine(db_url)
    event.listen(engine, "before_cursor_execute", lambda conn, cursor, st, params, context, many: statements.append((st, params)))
    with Session(engine) as session:
        assert cat.ranked_ids(session, "alpha film 1", {}, 100) == []
        st, params = statements[-1]
        if not db_url.startswith("postgresql"):  # SQLite: the words looked up alone first, `film` found in none
            assert [p for s, p in statements if "EXISTS" in s] == [('"alpha"',), ('"film"',)]
            return
        (plan,) = session.connection().exec_driver_sql("EXPLAIN (ANALYZE, FORMAT JSON) " + st, params).scalar_one()
    scans = [n for n in _plan_nodes(plan["Plan"]) if n["Node Type"].endswith("Scan")]
    searched = [n for n in scans if ":*" in json.dumps({k: v for k, v in n.items() if k != "Plans"})]
    assert searched and all(n["Actual Loops"] == 0 for n in searched)  # the prefix's search never ran: `film` is in no document
