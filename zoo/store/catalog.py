"""Catalog search (the search page, `GET /api/v1/adapters`, `zoo list`): free text over each adapter's
search document with the database's own full-text index (its words and documents: zoo/store/search_text.py), the
engine's filters, facets, sorts and pages."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NotRequired, TypedDict

from sqlalchemy import (
    CTE,
    ColumnClause,
    ColumnElement,
    Integer,
    Row,
    Select,
    SQLColumnExpression,
    String,
    and_,
    case,
    cast,
    column,
    func,
    literal,
    literal_column,
    not_,
    or_,
    select,
    table,
    union_all,
)
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from zoo import config
from zoo.errors import UsageError
from zoo.limits import DEFAULT_PER_PAGE, MAX_PER_PAGE
from zoo.store import repository
from zoo.store.filters import label_key
from zoo.store.models import SQLITE_FTS_TABLE, Adapter, AdapterText, Label
from zoo.store.search_text import as_tsquery, fts5_query_text, other_words_found, query_phrases
from zoo.store.session import read_snapshot

SORTS = ("relevance", "name", "newest", "rank")
#: facets of adapter columns, in the order they are returned; the source's facets (repository.SOURCE_FIELDS: author,
#: license, pipeline_tag, library, base_model_relation) follow where they have values, then label facets as `label:<key>`
COLUMN_FACETS = ("base_model", "format", "rank", "source")
#: values kept per facet, the most frequent first
FACET_VALUES = 50
#: facets (and the total) over more matching adapters than facet_exact_rows() are counted in a sample of about this
#: many adapters and scaled: unfiltered facets of a million adapters took 9 s on PostgreSQL
FACET_SAMPLE_ROWS = 8_000
#: runs of consecutive ids the sample is made of
SAMPLE_WINDOWS = 40
#: milliseconds exact facets may take on PostgreSQL before they are counted in the sample instead: longer with
#: filters, whose few matches a sample would mostly miss (5 filters keeping 666 of 1M adapters: the facets of each
#: filter's alternatives read 100,000 adapters, 0.3-0.8 s)
FACET_TIMEOUT_MS = 150
FILTERED_FACET_TIMEOUT_MS = 1500
#: past this many matches (estimated), a query without a chosen sort shows the newest first, not the most relevant
RANK_ROWS = 20_000
#: the matches a search by meaning's full-text list (ranked_ids) ranks at most: it is one list of a hundred fused with
#: three others, and ranking every match of a common word costs its matches (200,000 took 330 ms; each match is a
#: page read: 2,000 took 25 ms at 200k adapters)
RANKED_LIST_ROWS = 500


def facet_exact_rows() -> int:
    """Matching adapters (PostgreSQL's estimate) up to which facets and the total are exact (ZOO_FACET_EXACT_ROWS,
    default 10,000); past it they are counted in a sample and flagged `approximate`."""
    return config.FACET_EXACT_ROWS.get()


_TOTAL = "total"
_FTS = table(SQLITE_FTS_TABLE, column("rowid", Integer))
_FTS_NAME: ColumnClause[Any] = literal_column(SQLITE_FTS_TABLE)
#: a condition keeping the adapters of a sample (None: all)
Within = ColumnElement[bool] | None
_FACET_EXPRESSIONS: dict[str, SQLColumnExpression[Any]] = {
    "base_model": Adapter.base_model,
    "format": Adapter.format,
    "rank": cast(Adapter.rank, String),
    # the source URI up to its last "/": its directory (rolled up to ancestor directories in Python)
    "source": func.rtrim(Adapter.source_uri, func.replace(Adapter.source_uri, literal_column("'/'"), literal_column("''"))),
    **repository.SOURCE_FIELDS,
}


def _restrict(
    stmt: Select, dialect: str, phrases: list[list[str]], filters: Mapping[str, str], per_row: bool = False, inline: bool = False
) -> tuple[Select, ColumnElement[Any] | None]:
    """stmt (over Adapter) kept to adapters matching the phrases and filters, and the relevance order
    (best first) when there are phrases. `per_row` (PostgreSQL): each adapter's document is looked up and
    matched by itself, for a few thousand adapters kept otherwise (a sample), instead of every match of the
    text index being joined to them (83,000 for one phrase: 0.55 s). `inline`: see as_tsquery."""
    conditions, labels = repository.split_filters(filters)
    for key, value in labels:
        given = select(Label.adapter_id).where(Label.key == key, Label.value == value, Label.source == "given")
        conditions.append(Adapter.id.in_(given))
    stmt = stmt.where(*conditions)
    if not phrases:
        return stmt, None
    if dialect == "postgresql":
        tsquery = as_tsquery(phrases, inline)
        if per_row:
            document = select(AdapterText.document_tsv).where(AdapterText.adapter_id == Adapter.id).scalar_subquery()
            return stmt.where(document.bool_op("@@")(tsquery)), None
        stmt = stmt.join(AdapterText, AdapterText.adapter_id == Adapter.id).where(AdapterText.document_tsv.bool_op("@@")(tsquery))
        return stmt, func.ts_rank(AdapterText.document_tsv, tsquery).desc()
    # `rowid + 0` keeps SQLite from putting the FTS table in the inner loop (one full-text search per
    # adapter kept by a filter): it runs the search once and looks the hits' adapters up by id
    stmt = stmt.join(_FTS, Adapter.id == _FTS.c.rowid + 0).where(_FTS_NAME.bool_op("MATCH")(fts5_query_text(phrases)))
    return stmt, func.bm25(_FTS_NAME)


def _order(sort: str, dialect: str, relevance: ColumnElement[Any] | None) -> list[SQLColumnExpression[Any]]:
    if sort == "relevance" and relevance is not None:
        return [relevance, Adapter.id]
    if sort == "name":  # code point order on both databases (SQLite's default collation)
        return [Adapter.name.collate("C") if dialect == "postgresql" else Adapter.name, Adapter.id]
    if sort == "rank":
        return [Adapter.rank.asc().nulls_last(), Adapter.id]
    return [Adapter.created_at.desc(), Adapter.id.desc()]


def _matching(dialect: str, phrases: list[list[str]], filters: Mapping[str, str], name: str, within: Within = None) -> CTE:
    """The ids of the adapters matching the phrases and filters (within the sample), with their column facets' values."""
    columns: list[SQLColumnExpression[Any]] = [Adapter.id, *(expr.label(key) for key, expr in _FACET_EXPRESSIONS.items())]
    stmt = _restrict(select(*columns), dialect, phrases, filters, per_row=within is not None)[0]
    return (stmt if within is None else stmt.where(within)).cte(name)


def _column_facet(matching: CTE, key: str) -> Select:
    """(facet, value, n) for one adapter column over the matching adapters."""
    value = matching.c[key]
    return (
        select(literal(key).label("facet"), value.label("value"), func.count().label("n"))
        .where(value.is_not(None), value != "")
        .group_by(value)
    )


def _label_facets(matching: CTE, exclude: Iterable[str] = ()) -> Select:
    """(`label:<key>`, value, n) over the matching adapters' given labels of every key but `exclude` (a label named
    like a field too: its facet is chosen by `label.<key>=value`, zoo.store.filters)."""
    stmt = select((literal("label:") + Label.key).label("facet"), Label.value, func.count())
    stmt = stmt.join(matching, matching.c.id == Label.adapter_id).where(Label.source == "given")
    excluded = list(exclude)
    return (stmt.where(Label.key.not_in(excluded)) if excluded else stmt).group_by(Label.key, Label.value)


def _filter_condition(key: str, value: str) -> ColumnElement[bool]:
    """The condition on Adapter of one filter (see repository.split_filters)."""
    conditions, labels = repository.split_filters({key: value})
    if conditions:
        return conditions[0]
    return Adapter.id.in_(_filter_ids(key, value))


def _filter_ids(key: str, value: str) -> Select:
    """The ids of the adapters one filter keeps, read through that filter's own index (a label's, or the column's)."""
    if key in repository.COLUMN_FILTERS:
        return select(Adapter.id).where(_filter_condition(key, value))
    return select(Label.adapter_id).where(Label.key == label_key(key), Label.value == value, Label.source == "given")


#: what reading one candidate by id costs (its row and its labels, random reads) against one id of a filter's own index
CANDIDATE_READ_COST = 20


def _candidate_filters(session: Session, dialect: str, filters: Mapping[str, str]) -> list[str]:
    """The filters through which the facets' candidates are read (_near_matches): an adapter missing at most one
    filter is kept by at least one of any two and by at least two of any three. On PostgreSQL, by the planner's
    estimate of each filter alone (a millisecond each), the two narrowest, or the three narrowest when reading the
    third filter's ids costs less than the candidates it saves reading by id (CANDIDATE_READ_COST; at a million
    adapters, a source prefix, a task and a style: 20,000 candidates through two, 4,700 through three). Elsewhere the
    labels first, then the base model, then other columns."""
    if len(filters) < 2:
        return []
    if dialect != "postgresql":
        return sorted(filters, key=lambda k: (k in repository.COLUMN_FILTERS, k != "base_model"))[:2]
    estimates = sorted((_estimated_matches(session, dialect, [], {k: v}), k) for k, v in filters.items())
    if len(estimates) < 3:
        return [k for _, k in estimates]
    (a, _), (b, _), (c, _) = estimates[:3]
    total = max(_estimated_matches(session, dialect, [], {}), 1.0)
    through_two = (a + b) * (1 + CANDIDATE_READ_COST)
    through_three = a + b + c + CANDIDATE_READ_COST * (a * b + a * c + b * c) / total
    return [k for _, k in estimates[: 3 if through_three < through_two else 2]]


def _near_matches(
    dialect: str, phrases: list[list[str]], filters: Mapping[str, str], within: Within = None, through: Sequence[str] = ()
) -> CTE:
    """The adapters matching the phrases and all the filters but at most one, with their column facets' values,
    `misses` (filters they fail), `col_misses` (column filters they fail) and `miss_<i>` (1 if they fail the i-th
    column filter). A facet of a filtered key counts the adapters that miss no filter or only its own: one pass
    for every filter, where a matching set per filter cost O(filters²) (150 filters took 14.7 s).
    With two filters or more the candidates are not the whole catalog but the adapters kept by all but one of
    `through` (two or three filters, see _candidate_filters; each read through its own index); with two label
    filters or more, only those that also have all the filtered labels but one."""
    columns: list[SQLColumnExpression[Any]] = [Adapter.id, *(expr.label(key) for key, expr in _FACET_EXPRESSIONS.items())]
    column_keys = [k for k in filters if k in repository.COLUMN_FILTERS]
    pairs = [(label_key(k), v) for k, v in filters.items() if k not in repository.COLUMN_FILTERS]
    candidates = None
    if through:
        ids = union_all(*(_filter_ids(k, filters[k]) for k in through)).subquery("through")
        kept = select(ids.c[0].label("id")).group_by(ids.c[0]).having(func.count() >= len(through) - 1)
        candidates = kept.cte("candidates")
    flags = [case((_filter_condition(k, filters[k]), 0), else_=1) for k in column_keys]  # NULL (no value): a miss
    col_misses = sum(flags[1:], flags[0]) if flags else literal(0)
    stmt = select(*columns, *(f.label(f"miss_{i}") for i, f in enumerate(flags)), col_misses.label("col_misses"))
    if pairs:
        given = (
            select(Label.adapter_id, func.count().label("hits"))
            .where(Label.source == "given", or_(*(and_(Label.key == k, Label.value == v) for k, v in pairs)))
            .group_by(Label.adapter_id)
        )
        if len(pairs) >= 2:  # missing at most one filter, an adapter has all its label filters' labels but one at most
            given = given.having(func.count() >= len(pairs) - 1)
        if candidates is not None:  # joined, not `IN`: the planner's guess of the candidates' count is far too low
            given = given.join(candidates, candidates.c.id == Label.adapter_id)
        hits = given.subquery("hits")
        stmt = stmt.add_columns((col_misses + len(pairs) - func.coalesce(hits.c.hits, 0)).label("misses"))
        if len(pairs) >= 2:
            stmt = stmt.join(hits, hits.c.adapter_id == Adapter.id)
        else:
            stmt = stmt.outerjoin(hits, hits.c.adapter_id == Adapter.id)
    else:
        stmt = stmt.add_columns(col_misses.label("misses"))
    stmt = _restrict(stmt, dialect, phrases, {}, per_row=within is not None)[0]
    if within is not None:
        stmt = stmt.where(within)
    if candidates is not None:
        stmt = stmt.join(candidates, candidates.c.id == Adapter.id)
    near = stmt.subquery("scored")
    return select(near).where(near.c.misses <= 1).cte("near")


def _facets_statement(
    dialect: str, phrases: list[list[str]], filters: Mapping[str, str], within: Within = None, through: Sequence[str] = ()
) -> Select:
    """One statement for the total and every facet. A facet counts the adapters matching the query and
    every filter but its own (so it shows the alternatives to a chosen value), read from the one set of
    adapters that miss at most one filter (_near_matches, its candidates read `through` these filters): the
    statement grows with the filters, not with their square. `within`: only the adapters of a sample (see _sample)."""
    if not filters:
        matching = _matching(dialect, phrases, filters, "matching", within)
    else:
        near = _near_matches(dialect, phrases, filters, within, through)
        matching = select(near).where(near.c.misses == 0).cte("matching")
    parts = [select(literal(_TOTAL).label("facet"), literal("").label("value"), func.count().label("n")).select_from(matching)]
    parts += [_column_facet(matching, key) for key in (*COLUMN_FACETS, *repository.SOURCE_FIELDS) if key not in filters]
    parts.append(_label_facets(matching, exclude=[label_key(k) for k in filters if k not in repository.COLUMN_FILTERS]))
    column_keys = [k for k in filters if k in repository.COLUMN_FILTERS]
    for i, key in enumerate(column_keys):  # its own filter missed, or none (relation filters have no facet)
        if key in _FACET_EXPRESSIONS:
            parts.append(_column_facet(near, key).where(or_(near.c.misses == 0, near.c[f"miss_{i}"] == 1)))
    pairs = [(label_key(k), v) for k, v in filters.items() if k not in repository.COLUMN_FILTERS]
    if pairs:
        # an adapter that misses one label filter and no column filter has one given label of the filtered keys that
        # differs from its filter: that label's key is the one it misses, and the label's value counts in its facet
        own = select((literal("label:") + Label.key).label("facet"), Label.value, func.count())
        own = own.join(near, near.c.id == Label.adapter_id).where(Label.source == "given", Label.key.in_([k for k, _ in pairs]))
        differs = not_(or_(*(and_(Label.key == k, Label.value == v) for k, v in pairs)))
        parts.append(own.where(or_(near.c.misses == 0, and_(near.c.col_misses == 0, differs))).group_by(Label.key, Label.value))
    g = union_all(*parts).subquery()
    place = func.row_number().over(partition_by=g.c.facet, order_by=(g.c.n.desc(), g.c.value)).label("place")
    ranked = select(g.c.facet, g.c.value, g.c.n, place).subquery()
    return select(ranked.c.facet, ranked.c.value, ranked.c.n).where(or_(ranked.c.place <= FACET_VALUES, ranked.c.facet == "source"))


def _estimated_matches(session: Session, dialect: str, phrases: list[list[str]], filters: Mapping[str, str]) -> float:
    """PostgreSQL's estimate of the adapters matching the phrases and filters (planning only: a millisecond or
    two); 0 on SQLite, whose facets are always exact."""
    if dialect != "postgresql":
        return 0.0
    stmt = _restrict(select(Adapter.id), dialect, phrases, filters)[0]
    compiled = stmt.compile(dialect=session.get_bind().dialect, compile_kwargs={"render_postcompile": True})  # text stays bound
    plan = session.connection().exec_driver_sql(f"EXPLAIN (FORMAT JSON) {compiled}", compiled.params).scalar_one()
    plan = json.loads(plan) if isinstance(plan, str) else plan
    return float(plan[0]["Plan"]["Plan Rows"])


def _most_matches(session: Session, dialect: str, phrases: list[list[str]], estimate: float) -> float:
    """An estimate that errs high: the fewest matches of any one word of the query (the planner's estimate of a
    phrase assumes its words independent: `pixel art`, 83,000 matches, was estimated at 7,500)."""
    words = [[w] for phrase in phrases for w in phrase][:8]
    if dialect != "postgresql" or len(words) < 2:
        return estimate
    return max(estimate, min(_estimated_matches(session, dialect, [w], {}) for w in words))


def _sample(session: Session) -> tuple[ColumnElement[bool], float]:
    """A systematic sample of about FACET_SAMPLE_ROWS adapters: SAMPLE_WINDOWS runs of consecutive ids spread
    evenly over the ids in use (each an index range: read at once, on any database), and the factor that scales
    a count within it to the whole catalog."""
    low, high = session.execute(select(func.min(Adapter.id), func.max(Adapter.id))).one()
    span = (high or 0) - (low or 0) + 1
    width = max(1, FACET_SAMPLE_ROWS // SAMPLE_WINDOWS)
    stride = max(width, span // SAMPLE_WINDOWS)
    windows = [(low + i * stride, low + i * stride + width - 1) for i in range(SAMPLE_WINDOWS) if i * stride < span]
    covered = sum(min(hi, high) - lo + 1 for lo, hi in windows)
    return or_(*(Adapter.id.between(lo, hi) for lo, hi in windows)), span / max(covered, 1)


def _exact_facets(session: Session, dialect: str, stmt: Select, timeout_ms: int) -> Sequence[Row] | None:
    """The facet statement's rows; on PostgreSQL None past timeout_ms (an estimate can be far off: a phrase
    matching 83,000 adapters was estimated at a few thousand), its transaction left as it was."""
    if dialect != "postgresql":
        return session.execute(stmt).all()
    previous = session.execute(select(func.current_setting("statement_timeout"))).scalar_one()
    try:
        with session.begin_nested():
            session.execute(select(func.set_config("statement_timeout", str(timeout_ms), True)))
            rows = session.execute(stmt).all()
            session.execute(select(func.set_config("statement_timeout", previous, True)))
            return rows
    except DBAPIError as exc:
        if getattr(exc.orig, "sqlstate", None) != "57014":  # query_canceled: the statement timeout
            raise
        return None


def _roll_up(directories: dict[str, int]) -> dict[str, int]:
    """Counts per directory including the directories below it (what the `source` prefix filter keeps)."""
    out = dict.fromkeys(directories, 0)
    for path, n in directories.items():
        end = len(path)
        while end > 0:
            if path[:end] in out:
                out[path[:end]] += n
            end = path.rfind("/", 0, end - 1) + 1
    return out


class FacetValue(TypedDict):
    value: str | int  # an int for rank
    count: int


class CatalogHit(repository.AdapterSummary):
    labels: dict[str, str]  # given labels
    tags: list[str]
    why: NotRequired[list[str]]  # a search by meaning: why it matched ("text", "predicted task=x (p=0.83)", "near #N")


class CatalogPage(TypedDict):
    """One page of the catalog (search_catalog)."""

    q: str | None
    filters: dict[str, str]
    sort: str
    page: int
    per_page: int
    total: int
    approximate: bool
    results: list[CatalogHit]
    facets: dict[str, list[FacetValue]]
    semantic: NotRequired[bool]  # ranked by meaning (embed/serving/text_search.py): the total counts the ranked adapters


def _facet_values(counts: dict[Any, int]) -> list[FacetValue]:
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:FACET_VALUES]
    return [{"value": value, "count": n} for value, n in ordered]


def _read_facets(rows: Iterable[tuple[str, str, int]], scale: float = 1.0) -> tuple[int, dict[str, list[FacetValue]]]:
    total = 0
    counts: dict[str, dict[Any, int]] = {key: {} for key in COLUMN_FACETS}
    for facet, value, n in rows:
        n = round(n * scale)
        if facet == _TOTAL:
            total = n
        else:
            counts.setdefault(facet, {})[int(value) if facet == "rank" else value] = n
    counts["source"] = _roll_up(counts["source"])
    given = [k for k in repository.SOURCE_FIELDS if counts.get(k)]
    labels = sorted(k for k in counts if k not in COLUMN_FACETS and k not in repository.SOURCE_FIELDS)
    return total, {key: _facet_values(counts[key]) for key in [*COLUMN_FACETS, *given, *labels]}


def _checked_sort(sort: str | None, phrases: list[list[str]], page: int, per_page: int) -> str:
    """The sort to apply (relevance needs query words; without them the newest come first)."""
    if sort is not None and sort not in SORTS:
        raise UsageError(f"sort {sort!r}: use one of {', '.join(SORTS)}")
    if not 1 <= per_page <= MAX_PER_PAGE:
        raise UsageError(f"per_page {per_page}: at least 1 and at most {MAX_PER_PAGE}")
    if page < 1:
        raise UsageError(f"page {page}: pages count from 1")
    if sort in (None, "relevance"):
        return "relevance" if phrases else "newest"
    return sort


def search_catalog(
    session: Session, q: str | None, filters: Mapping[str, str], sort: str | None = None, page: int = 1, per_page: int = DEFAULT_PER_PAGE
) -> CatalogPage:
    """One page of the adapters matching free text `q` and `filters` (the engine's: base_model, format,
    rank, source prefix, the source's fields (author, license, pipeline_tag, library, base_model_relation), any
    other key a given label), with the total and facets, as a plain dict.

    Sorts: relevance (the default with query words: PostgreSQL ts_rank, SQLite bm25; newest instead when no sort
    is asked for and PostgreSQL estimates more than RANK_ROWS matches), name (code point order), newest (the default
    otherwise), rank (LoRA rank, unknown last). Statements: the page, its labels, and the total with every facet;
    on PostgreSQL also the planner's estimate of the matches: past facet_exact_rows(), or when the exact facets run
    past FACET_TIMEOUT_MS (FILTERED_FACET_TIMEOUT_MS with filters), the total and facets are counted in a sample of
    ids and scaled (`approximate`). One snapshot (zoo.store.session.read_snapshot) where the session's transaction
    has not begun."""
    phrases = query_phrases(q)
    asked, sort = sort, _checked_sort(sort, phrases, page, per_page)
    read_snapshot(session)  # the page, its labels and the facets from one snapshot, whatever is deleted meanwhile
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":  # compiling these statements to machine code cost 140 ms each at 1M adapters
        session.execute(select(func.set_config("jit", "off", True)))  # for this transaction only
    estimate = _estimated_matches(session, dialect, phrases, filters)
    if asked is None and sort == "relevance" and _most_matches(session, dialect, phrases, estimate) > RANK_ROWS:
        sort = "newest"  # ranking 200,000 matches took 330 ms; the newest are found through an index
    stmt, relevance = _restrict(select(Adapter), dialect, phrases, filters)
    stmt = stmt.order_by(*_order(sort, dialect, relevance)).limit(per_page).offset((page - 1) * per_page)
    adapters = list(session.scalars(stmt))
    labels = repository.names_and_labels(session, [a.id for a in adapters])
    approximate = estimate > facet_exact_rows()
    timeout = FILTERED_FACET_TIMEOUT_MS if filters else FACET_TIMEOUT_MS
    through = _candidate_filters(session, dialect, filters)
    statement = _facets_statement(dialect, phrases, filters, through=through)
    rows = None if approximate else _exact_facets(session, dialect, statement, timeout)
    scale = 1.0
    if rows is None:  # too many matches, estimated or found past FACET_TIMEOUT_MS
        approximate = True
        within, scale = _sample(session)
        rows = session.execute(_facets_statement(dialect, phrases, filters, within, through)).all()
    total, facets = _read_facets(rows, scale)
    results = [_hit(a, labels[a.id][1]) for a in adapters]
    return {
        "q": q,
        "filters": dict(filters),
        "sort": sort,
        "page": page,
        "per_page": per_page,
        "total": total,
        "approximate": approximate,
        "results": results,
        "facets": facets,
    }


def _hit(a: Adapter, labels: dict[str, str]) -> CatalogHit:
    return {**repository.adapter_summary(a), "labels": labels, "tags": a.tags or []}


def ranked_ids(session: Session, q: str | None, filters: Mapping[str, str], limit: int) -> list[int]:
    """The ids of the `limit` most relevant adapters matching free text `q` and `filters` (none without query words):
    full text's list in a search by meaning. One statement that ranks at most RANKED_LIST_ROWS matches (the first
    the text index gives): all of them when there are no more, so its cost is bounded by that, not by how many
    adapters a common word matches."""
    phrases = query_phrases(q)
    if not phrases:
        return []
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        score, best_first = func.ts_rank(AdapterText.document_tsv, as_tsquery(phrases, inline=True)), True
    else:
        score, best_first = func.bm25(_FTS_NAME), False  # lower is better
    matching = _restrict(select(Adapter.id, score.label("score")), dialect, phrases, filters, inline=True)[0]
    matches = matching.where(*other_words_found(session, phrases)).limit(RANKED_LIST_ROWS).subquery()
    order = matches.c.score.desc() if best_first else matches.c.score.asc()
    return list(session.scalars(select(matches.c.id).order_by(order, matches.c.id).limit(limit)))


def kept_ids(session: Session, ids: Sequence[int], filters: Mapping[str, str]) -> set[int]:
    """Those of `ids` that the filters keep."""
    if not ids:
        return set()
    dialect = session.get_bind().dialect.name
    return set(session.scalars(_restrict(select(Adapter.id).where(Adapter.id.in_(list(ids))), dialect, [], filters)[0]))


def facets_of(session: Session, ids: Sequence[int]) -> dict[str, list[FacetValue]]:
    """The facets of these adapters (a ranked list's, not a query's matches): their facet columns and given labels
    read by id and counted here, a cost of the few hundred ids (one grouping statement had SQLite scan every label of
    a million adapters: 350 ms)."""
    wanted = sorted(set(ids))
    counts: Counter[tuple[str, Any]] = Counter()
    columns: list[SQLColumnExpression[Any]] = [expr.label(key) for key, expr in _FACET_EXPRESSIONS.items()]
    for row in session.execute(select(*columns).where(Adapter.id.in_(wanted))):
        counts.update((key, value) for key, value in row._mapping.items() if value is not None and value != "")
    given = select(Label.key, Label.value).where(Label.adapter_id.in_(wanted), Label.source == "given")
    counts.update((f"label:{key}", value) for key, value in session.execute(given))
    return _read_facets((facet, value, n) for (facet, value), n in counts.items())[1]


def catalog_hits(session: Session, ids: Sequence[int]) -> list[CatalogHit]:
    """The catalog's rows of these adapters in this order (ids of deleted adapters left out)."""
    adapters = {a.id: a for a in session.scalars(select(Adapter).where(Adapter.id.in_(list(ids))))} if ids else {}
    labels = repository.names_and_labels(session, list(adapters))
    return [_hit(adapters[i], labels[i][1]) for i in ids if i in adapters]
