"""The bounded parts of a search by meaning: full text's list ranks at most RANKED_LIST_ROWS matches in one statement,
and the facets of a ranked list are those of its adapters, on both databases."""

from __future__ import annotations

import pytest

from tests.test_catalog import catalog, synthetic_zoo
from zoo.limits import MAX_PER_PAGE
from zoo.store import catalog as cat
from zoo.store.session import session_factory


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
