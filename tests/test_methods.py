"""The methods as values (zoo.domain.methods): each has one name, its name parses back to it, and the names are
exactly those checkpoints, JSON output and the REST API have carried."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from embed.selection.choice import KNN_KS, KNN_TEMPERATURES
from embed.selection.search_choice import MIX_WEIGHTS
from zoo.domain.exact_scores import EXACT_SCORES
from zoo.domain.methods import (
    LEARNED,
    MAX_RERANK_TOP,
    KnnPredictor,
    LearnedPredictor,
    Predictor,
    SearchScore,
    fitted_score,
    fused_score,
    parse_predictor,
)

#: W2T weights: those the choice tries, and any of six decimals
weights = st.one_of(st.sampled_from((0.0, *MIX_WEIGHTS)), st.integers(0, 10**6).map(lambda i: i / 10**6))
one_stage_scores = st.builds(SearchScore, st.sampled_from(EXACT_SCORES), weights)


@st.composite
def two_stage_scores(draw: st.DrawFn) -> SearchScore:
    """A first stage below W2T alone, a lighter second, a top of 2 to MAX_RERANK_TOP."""
    first = draw(weights.filter(lambda w: 0 < w < 1))
    second = draw(weights.filter(lambda w: w < first))
    return SearchScore(draw(st.sampled_from(EXACT_SCORES)), first, second, draw(st.integers(2, MAX_RERANK_TOP)))


#: a channel metric's first stage, its top re-ordered by its fusion with dW at the same weight
fused_stage_scores = st.builds(
    lambda purpose, w, top: SearchScore(fitted_score(purpose), w, w, top, fused_score(purpose)),
    st.sampled_from(["search", "task"]),
    weights.filter(lambda w: w < 1),
    st.integers(2, MAX_RERANK_TOP),
)
search_scores = st.one_of(one_stage_scores, two_stage_scores(), fused_stage_scores)
#: kNN temperatures: none, those the choice tries, and any positive float as its name writes it
temperatures = st.one_of(
    st.none(),
    st.sampled_from(KNN_TEMPERATURES),
    st.floats(1e-12, 1e6, allow_nan=False, allow_infinity=False).map(lambda t: float(f"{t:g}")),
)
predictors: st.SearchStrategy[Predictor] = st.one_of(
    st.builds(KnnPredictor, one_stage_scores, st.integers(1, 10_000), temperatures, temperatures),
    st.sampled_from(LEARNED).map(LearnedPredictor),
)


def old_search_name(exact: str, weight: float) -> str:
    """How search scores were named before they were values (embed.selection.choice.search_name)."""
    if weight <= 0:
        return exact
    return "w2t" if weight >= 1 else f"{exact}+w2t@{weight:g}"


#: every name written so far: search scores, kNN predictors over them with the k tried, learned predictors
SEARCH_NAMES = sorted({old_search_name(e, w) for e in EXACT_SCORES for w in (0.0, *MIX_WEIGHTS)})
PREDICTOR_NAMES = [f"knn {s} k={k}" for s in SEARCH_NAMES for k in KNN_KS] + list(LEARNED)
PREDICTOR_NAMES += [f"knn {s} k={k} T={t:g}" for s in SEARCH_NAMES for k in KNN_KS for t in KNN_TEMPERATURES]


@given(search_scores)
def test_a_search_score_parses_back_from_its_name(score: SearchScore) -> None:
    assert SearchScore.parse(score.name) == score


@given(predictors)
def test_a_predictor_parses_back_from_its_name(predictor: Predictor) -> None:
    assert parse_predictor(predictor.name) == predictor == type(predictor).parse(predictor.name)


@given(st.sampled_from(EXACT_SCORES), st.floats(0, 1))
def test_any_weight_either_round_trips_or_is_refused(exact: str, weight: float) -> None:
    try:
        score = SearchScore(exact, weight)
    except ValueError:
        return
    assert SearchScore.parse(score.name) == score and score.w2t_weight == weight


@pytest.mark.parametrize("name", SEARCH_NAMES)
def test_every_search_name_in_use_round_trips(name: str) -> None:
    assert SearchScore.parse(name).name == name


@pytest.mark.parametrize("name", PREDICTOR_NAMES)
def test_every_predictor_name_in_use_round_trips(name: str) -> None:
    assert parse_predictor(name).name == name


def test_a_second_stage_is_named_and_kept_apart_from_what_a_knn_votes_by() -> None:
    staged = SearchScore.parse("module+w2t@0.8 then top 10 by module+w2t@0.1")
    assert staged == SearchScore("module", 0.8, 0.1, 10) and staged.second_stage == SearchScore("module", 0.1)
    assert staged.first_stage == SearchScore("module", 0.8) and SearchScore("module", 0.8).second_stage is None
    assert SearchScore("dw", 0.5, 0.0, 5).name == "dw+w2t@0.5 then top 5 by dw"
    with pytest.raises(ValueError, match="votes by one similarity"):
        KnnPredictor(staged, 3)


def test_names_as_they_were_written() -> None:
    assert SearchScore.parse("module+w2t@0.1") == SearchScore("module", 0.1)
    assert SearchScore.parse("w2t") == SearchScore("dw", 1.0) == SearchScore("module", 1.0)  # W2T alone mixes in nothing
    assert SearchScore.parse("dw") == SearchScore() and SearchScore("module").name == "module"
    assert parse_predictor("knn module+w2t@0.1 k=10") == KnnPredictor(SearchScore("module", 0.1), 10)
    assert parse_predictor("knn w2t k=3").kind == "knn" and parse_predictor("logreg") == LearnedPredictor("logreg")
    assert parse_predictor("neighbours").kind == "neighbours"
    assert parse_predictor("knn input_gram k=10 T=0.01") == KnnPredictor(SearchScore("input_gram"), 10, 0.01)
    staged = SearchScore.parse("metric:search then top 10 by fused:search")
    assert staged == SearchScore("metric:search", 0.0, 0.0, 10, "fused:search") and staged.second_stage == SearchScore("fused:search")
    assert staged.first_stage == SearchScore("metric:search") and SearchScore.parse("fused:search").fitted == "search"
    assert KnnPredictor(SearchScore(), 3, 0.003).name == "knn dw k=3 T=0.003" and KnnPredictor(SearchScore(), 3).temperature is None
    assert parse_predictor("knn centred_gram k=30 T=0.01 h=2.79") == KnnPredictor(SearchScore("centred_gram"), 30, 0.01, 2.79)
    assert KnnPredictor(SearchScore(), 10, None, 1.5).name == "knn dw k=10 h=1.5"
    trended = KnnPredictor(SearchScore("module_centred"), 10, 0.01, None, True)
    assert trended.name == "knn module_centred k=10 T=0.01 trend" and parse_predictor(trended.name) == trended
    assert parse_predictor("knn dw k=30 h=2.5 trend") == KnnPredictor(SearchScore(), 30, None, 2.5, True)


@pytest.mark.parametrize(
    "name",
    ["", "DW", "dw ", "cosine", "w2t+w2t@0.3", "dw+w2t@", "dw+w2t@0", "dw+w2t@1", "dw+w2t@0.30", "dw+w2t@.3", "dw+w2t@1.5"]
    + ["dw+w2t@-0.1", "dw+w2t@nan", "dw+w2t@inf", "foo+w2t@0.3", "module+w2t@0.3+w2t@0.3", "knn dw k=3"]
    # second stages: heavier or as heavy as the first, after W2T alone, another exact score, a top out of range
    + ["dw+w2t@0.3 then top 10 by dw+w2t@0.5", "dw+w2t@0.3 then top 10 by dw+w2t@0.3", "w2t then top 10 by dw"]
    + ["dw+w2t@0.8 then top 10 by module", "dw+w2t@0.8 then top 1 by dw", "dw+w2t@0.8 then top 101 by dw"]
    + ["dw+w2t@0.8 then top 010 by dw", "dw+w2t@0.8 then top 10", "dw then top 10 by dw", "dw+w2t@0.8 then top 10 by "]
    + ["dw+w2t@0.8 then top ten by dw", "dw+w2t@0.8 then top 10 by dw then top 5 by dw"]
    # a fusion re-orders its own channel metric's top only, at that metric's W2T weight
    + ["dw then top 10 by fused:search", "metric:search then top 10 by fused:task", "metric:search+w2t@0.3 then top 10 by fused:search"]
    + [
        "fused:search then top 10 by metric:search",
        "metric:search then top 1 by fused:search",
        "fused:",
        "fused:search+w2t@0.3 then top 5 by dw",
    ],
)
def test_a_name_no_search_score_has_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="not a search score: " + re.escape(repr(name))):
        SearchScore.parse(name)


@pytest.mark.parametrize(
    "name",
    ["", "knn", "knn dw", "knn dw k=", "knn dw k=0", "knn dw k=-1", "knn dw k=03", "knn dw k= 3", "knn dw k=3 ", "knn foo k=3"]
    + ["knn  dw k=3", "knn dw+w2t@1 k=3", "dw k=3", "search", "Head", "head ", "knn head k=3"]
    # temperatures: none written, not positive, not finite, not as `:g` writes it, in the wrong place
    + ["knn dw k=3 T=", "knn dw k=3 T=0", "knn dw k=3 T=-0.1", "knn dw k=3 T=nan", "knn dw k=3 T=inf", "knn dw k=3 T=0.010"]
    + ["knn dw k=3 T=.01", "knn dw k=3  T=0.01", "knn dw T=0.01 k=3", "knn dw k=3 T=0.01 T=0.01", "knn dw T=0.01"]
    + ["knn dw k=3 trend trend", "knn dw k=3trend", "knn dw trend k=3", "knn dw k=3 trend T=0.01", "knn dw k=3 Trend"],
)
def test_a_name_no_predictor_has_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="not a (kNN )?predictor: " + re.escape(repr(name))):
        parse_predictor(name)


#: strings near the names: a start, a separator, a number or not
near_names = st.builds(
    "{}{}{}".format,
    st.sampled_from(["dw", "module", "w2t", "knn dw", "knn w2t"]),
    st.sampled_from(["+w2t@", " k=", " k=3 T=", ""]),
    st.text("0123456789.e-+ _", max_size=8),
)


@given(st.one_of(st.text(max_size=30), near_names))
def test_any_string_parses_only_as_what_it_names(name: str) -> None:
    for parse in (SearchScore.parse, parse_predictor):
        try:
            method = parse(name)
        except ValueError as refused:
            assert repr(name) in str(refused)
        else:
            assert method.name == name


def test_values_out_of_range_are_refused() -> None:
    for exact, weight in (("cosine", 0.0), ("dw", -0.1), ("dw", 1.5), ("dw", float("nan")), ("dw", 0.1234567)):
        with pytest.raises(ValueError):
            SearchScore(exact, weight)
    with pytest.raises(ValueError):
        KnnPredictor(SearchScore(), 0)
    with pytest.raises(ValueError, match="re-orders nothing"):
        SearchScore("metric:search", rerank_exact="fused:search")
    for temperature in (0.0, -1.0, float("nan"), float("inf"), 0.1234567):
        with pytest.raises(ValueError, match="temperature"):
            KnnPredictor(SearchScore(), 3, temperature)
    with pytest.raises(ValueError):
        LearnedPredictor("knn")
