"""Queries over adapters and modules; plain functions taking a session."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple, TypedDict, cast

from sqlalchemy import ColumnElement, Connection, Select, SQLColumnExpression, bindparam, delete, exists, func, select, union_all
from sqlalchemy.orm import Session, aliased, selectinload

from zoo.errors import UsageError
from zoo.store.filters import FIELDS, label_key, parse_filter
from zoo.store.models import Adapter, JobItem, Label, Measurement, Module
from zoo.store.relations import RELATION_FILTERS, relation_filter
from zoo.store.rows import columns


def adapter_blobs(session: Session) -> list[tuple[int, str]]:
    """(adapter id, digest) of every blob a stored adapter refers to: its factors' and its PEFT head's."""
    rows = session.execute(select(Adapter.id, Adapter.factors_blob, Adapter.head_blob)).all()
    return [(int(i), str(d)) for i, factors, head in rows for d in (factors, head) if d is not None]


def adapter_count(session: Session) -> int:
    """How many adapters are stored."""
    return int(session.scalar(select(func.count()).select_from(Adapter)) or 0)


def get_adapter(session: Session, adapter_id: int, with_modules: bool = False) -> Adapter | None:
    stmt = select(Adapter).where(Adapter.id == adapter_id)
    if with_modules:
        stmt = stmt.options(selectinload(Adapter.modules))
    return session.scalars(stmt).one_or_none()


#: near-duplicate candidates read on each side of an adapter's norm, the closest norms first: a re-factorized
#: copy's norm equals the original's to float precision, so it is among them unless this many stored adapters
#: of the same structure have norms closer still; the limit keeps the check O(1) in the size of the zoo
NEAR_DUPLICATE_LIMIT = 8


class Candidate(NamedTuple):
    """A stored adapter a new one may duplicate."""

    id: int
    canonical_hash: str
    factors_blob: str | None
    dw_norm: float | None
    #: its raw probe values (see zoo.domain.fingerprint.may_be_duplicate); None when stored before they were
    dw_probes: list | None = None
    name: str = ""


_CANDIDATE = select(Adapter.id, Adapter.canonical_hash, Adapter.factors_blob, Adapter.dw_norm, Adapter.dw_probes, Adapter.name).where(
    Adapter.base_model == bindparam("base_model")
)
_SAME_HASH = _CANDIDATE.where(Adapter.canonical_hash == bindparam("canonical_hash"))
_SAME_STRUCTURE = _CANDIDATE.where(Adapter.structure_hash == bindparam("structure_hash"))
_ABOVE = _SAME_STRUCTURE.where(Adapter.dw_norm.between(bindparam("norm"), bindparam("high"))).order_by(Adapter.dw_norm)
_BELOW = _SAME_STRUCTURE.where(Adapter.dw_norm < bindparam("norm"), Adapter.dw_norm >= bindparam("low")).order_by(Adapter.dw_norm.desc())
_CANDIDATES = union_all(
    _SAME_HASH,
    select(_ABOVE.limit(NEAR_DUPLICATE_LIMIT).subquery()),
    select(_BELOW.limit(NEAR_DUPLICATE_LIMIT).subquery()),
)


def duplicate_candidates(
    session: Session, base_model: str, canonical_hash: str, structure_hash: str, dw_norm: float | None, rtol: float
) -> list[Candidate]:
    """In one query: the adapter of this base model with this canonical hash, then (with a norm) up to
    NEAR_DUPLICATE_LIMIT adapters of the same base and structure on each side of dw_norm (an index range scan
    each) whose norms an update within rtol of it can have, dw_norm·(1 - rtol) to dw_norm/(1 - rtol), closest
    norm first."""
    params: dict[str, object] = {"base_model": base_model, "canonical_hash": canonical_hash}
    if dw_norm is None:
        rows = session.connection().execute(_SAME_HASH, params)
    else:
        params.update(structure_hash=structure_hash, norm=dw_norm, low=dw_norm * (1 - rtol), high=dw_norm / (1 - rtol))
        rows = session.connection().execute(_CANDIDATES, params)
    found = {row[0]: Candidate(*row) for row in rows}
    return sorted(found.values(), key=lambda c: (c.canonical_hash != canonical_hash, abs((c.dw_norm or 0.0) - (dw_norm or 0.0))))


class StoredCopy(NamedTuple):
    """A stored adapter read from a weight file with a given SHA-256."""

    id: int
    canonical_hash: str
    config: dict | None
    structure_hash: str
    dw_norm: float | None
    name: str


_STORED_COPIES = (
    select(Adapter.id, Adapter.canonical_hash, Adapter.config, Adapter.structure_hash, Adapter.dw_norm, Adapter.name)
    .where(Adapter.file_sha256 == bindparam("sha"), Adapter.base_model == bindparam("base_model"), Adapter.format == bindparam("fmt"))
    .order_by(Adapter.id)
)


def stored_copies(conn: Connection, file_sha256: str, base_model: str, fmt: str) -> list[StoredCopy]:
    """Adapters of this base model and format stored from a weight file with this SHA-256, oldest first."""
    rows = conn.execute(_STORED_COPIES, {"sha": file_sha256, "base_model": base_model, "fmt": fmt})
    return [StoredCopy(*row) for row in rows]


_COPY_SHAPES = (
    select(Adapter.id, Adapter.base_model, Module.name, Module.out_features, Module.in_features)
    .join(Module, Module.adapter_id == Adapter.id)
    .where(Adapter.file_sha256 == bindparam("sha"), Adapter.format == bindparam("fmt"))
    .order_by(Adapter.id)
)


def stored_copy_shapes(conn: Connection, file_sha256: str, fmt: str) -> list[tuple[str, list[tuple[str, int, int]]]]:
    """(base model, modules' (name, out, in)) of each adapter of this format stored from a weight file with this SHA-256,
    oldest first, under whatever base model."""
    copies: dict[int, tuple[str, list[tuple[str, int, int]]]] = {}
    for adapter_id, base_model, name, out, inp in conn.execute(_COPY_SHAPES, {"sha": file_sha256, "fmt": fmt}):
        copies.setdefault(int(adapter_id), (str(base_model), []))[1].append((str(name), int(out), int(inp)))
    return list(copies.values())


class AdapterSummary(TypedDict):
    """An adapter in a list: who it is and what it is."""

    id: int
    name: str
    base_model: str
    format: str
    rank: int | None
    alpha: float | None
    canonical_hash: str
    source_uri: str
    author: str | None
    created_at: str | None


class ModuleFields(TypedDict):
    """What a module row and its resource share: its name, LoRA settings and spectrum."""

    name: str
    layer_index: int | None
    module_type: str
    kind: str
    rank: int | None  # LoRA's: none for a full matrix
    canonical_rank: int | None
    alpha: float | None
    scale: float | None
    transposed: bool
    kernel: list[int] | None  # a conv module's [in_channels, k...]
    singular_values: list[float]
    spectral_norm: float
    frobenius_norm: float
    stable_rank: float
    effective_rank: float
    power_law_alpha: float | None
    power_law_xmin: float | None
    power_law_ks: float | None


class ModuleDetail(ModuleFields):
    """One adapted module of a stored adapter, with its spectrum."""

    shape: list[int]  # [out_features, in_features]


class AdapterDetail(AdapterSummary):
    """Everything stored about an adapter (`zoo show --json`)."""

    source_revision: str | None
    previous_version_id: int | None
    source_metadata: dict[str, Any]
    target_modules: list[str] | str | None  # as the PEFT config gave it: a list of names, or a regex or "all-linear"
    task_type: str | None
    structure_hash: str
    dw_norm: float | None
    file_sha256: str
    size_bytes: int
    factors_blob: str | None
    head_blob: str | None  # a PEFT head's tensors that are not LoRA factors (zoo.services.file_parts)
    config: dict[str, Any]
    file_metadata: dict[str, Any]
    extra_tensors: dict[str, Any]
    notes: list[str]
    license: str | None
    tags: list[str] | None
    labels: dict[str, str]  # given labels
    measurements: dict[str, float]  # test measurements
    modules: list[ModuleDetail]


#: the detail's keys that are not the adapter's own columns
DETAIL_DERIVED = ("labels", "measurements", "modules")


def adapter_summary(a: Adapter) -> AdapterSummary:
    return cast(AdapterSummary, columns(a, AdapterSummary.__annotations__))


def adapter_detail(a: Adapter) -> AdapterDetail:
    """Everything stored about an adapter, modules and spectra included."""
    fields = list(ModuleFields.__annotations__)  # name, layer index, type and kind; the shape; LoRA settings and spectrum
    modules = [{**columns(m, fields[:4]), "shape": [m.out_features, m.in_features], **columns(m, fields[4:])} for m in a.modules]
    own = [k for k in AdapterDetail.__annotations__ if k not in AdapterSummary.__annotations__ and k not in DETAIL_DERIVED]
    return cast(
        AdapterDetail,
        {
            **adapter_summary(a),
            **columns(a, own),
            "labels": {lb.key: lb.value for lb in a.labels if lb.source == "given"},
            "measurements": {m.metric: m.value for m in a.measurements if m.split == "test"},
            "modules": modules,
        },
    )


#: what a source (the Hub) said about an adapter, by filter and facet key (zoo.store.filters.SOURCE_KEYS): each matches exactly
SOURCE_FIELDS: dict[str, SQLColumnExpression[Any]] = {
    "author": Adapter.author,
    "license": Adapter.license,
    "pipeline_tag": Adapter.source_metadata["pipeline_tag"].as_string(),
    "library": Adapter.source_metadata["library_name"].as_string(),
    "base_model_relation": Adapter.source_metadata["base_model_relation"].as_string(),
}
#: filter keys that are conditions on adapters (columns, and relations found from the weights); any other key is a given label
COLUMN_FILTERS = FIELDS


def split_filters(filters: Mapping[str, str]) -> tuple[list[ColumnElement[bool]], list[tuple[str, str]]]:
    """Filters as conditions on adapters and (key, value) pairs of given labels: `base_model`, `format`, `rank` and
    the SOURCE_FIELDS (author, license, pipeline_tag, library, base_model_relation) match exactly, `source` is a
    prefix of the source URI, `relation` and `derived_from` read the relations found from the weights
    (zoo.store.relations.relation_filter), any other key is a label (zoo.store.filters.label_key: `label.rank` is the
    label rank)."""
    conditions: list[ColumnElement[bool]] = []
    labels: list[tuple[str, str]] = []
    for key, value in filters.items():
        if key in SOURCE_FIELDS:
            conditions.append(SOURCE_FIELDS[key] == value)
        elif key == "rank":
            if not (value.isascii() and value.isdigit() and len(value) <= 9):
                raise UsageError(f"filter rank={value!r}: the rank is a whole number below 10^9")
            conditions.append(Adapter.rank == int(value))
        elif key == "format":
            conditions.append(Adapter.format == value)
        elif key == "base_model":
            conditions.append(Adapter.base_model == value)
        elif key == "source":
            conditions.append(Adapter.source_uri.startswith(value, autoescape=True))
        elif key in RELATION_FILTERS:
            conditions.append(relation_filter(key, value))
        else:
            labels.append((label_key(key), value))
    return conditions, labels


#: filters one request may name: each is a condition in every catalog and filter statement
MAX_FILTERS = 32


def parse_filters(values: Iterable[str]) -> dict[str, str]:
    """`key=value` texts (the CLI's --filter, the API's filter parameter) as a mapping of filter names to values
    (zoo.store.filters: `label.rank=8` a label, `rank=8` the field); at most MAX_FILTERS."""
    values = list(values)
    if len(values) > MAX_FILTERS:
        raise UsageError(f"{len(values)} filters: a request may name at most {MAX_FILTERS}")
    parsed = [parse_filter(v) for v in values]
    return {f.name: f.value for f in parsed}


def filter_adapter_ids(session: Session, base_model: str, filters: Mapping[str, str]) -> list[int]:
    """Ids of adapters matching every filter, in one query (see split_filters).

    With a label filter the query reads that label's index entries and checks adapter columns only
    when a filter names one: ids of other base models may come back, for the caller's index of one
    space to ignore, so a filter that keeps 1 % of a million adapters reads 1 % of an index. Without
    one, it selects the base model's adapters."""
    conditions, labels = split_filters(filters)
    if not labels:
        return _first_column(session, select(Adapter.id).where(Adapter.base_model == base_model, *conditions).order_by(Adapter.id))
    (key, value), rest = labels[0], labels[1:]
    first = aliased(Label)
    stmt = select(first.adapter_id).where(first.key == key, first.value == value, first.source == "given")
    if conditions:
        stmt = stmt.where(exists().where(Adapter.id == first.adapter_id, *conditions))
    for key, value in rest:
        other = aliased(Label)
        stmt = stmt.where(
            exists().where(other.adapter_id == first.adapter_id, other.key == key, other.value == value, other.source == "given")
        )
    return _first_column(session, stmt.order_by(first.adapter_id))


def _first_column(session: Session, stmt: Select) -> list[int]:
    """The first column of every row, fetched by the driver in one call (no per-row result processing:
    a filter that keeps 1 % of a million adapters returns 10,000 ids)."""
    result = session.connection().execute(stmt)
    try:
        return [row[0] for row in result.cursor.fetchall()]
    finally:
        result.close()


_NAMES_AND_LABELS = (
    select(Adapter.id, Adapter.name, Label.key, Label.value)
    .outerjoin(Label, (Label.adapter_id == Adapter.id) & (Label.source == "given"))
    .where(Adapter.id.in_(bindparam("ids", expanding=True)))
)


def names_and_labels(session: Session, ids: Iterable[int]) -> dict[int, tuple[str, dict[str, str]]]:
    """{id: (name, given labels)} of the adapters, in one query."""
    ids = list(ids)
    if not ids:
        return {}
    rows = session.connection().execute(_NAMES_AND_LABELS, {"ids": ids}).all()  # Core: no ORM work per row
    out: dict[int, tuple[str, dict[str, str]]] = {}
    for adapter_id, name, key, value in rows:
        entry = out.setdefault(adapter_id, (name, {}))
        if key is not None:
            entry[1][key] = value
    return out


def duplicate_sources(session: Session, adapter_id: int) -> list[str]:
    """Sources other than its own found to be this adapter (same canonical form), each once, oldest first: by jobs, and by
    the ingest runs that are not jobs, which record theirs as a job's items too (zoo.store.jobs.record_duplicate)."""
    stmt = select(JobItem.source).where(JobItem.adapter_id == adapter_id, JobItem.state == "duplicate").order_by(JobItem.id)
    own = session.execute(select(Adapter.source_uri).where(Adapter.id == adapter_id)).scalar()
    return [s for s in dict.fromkeys(session.scalars(stmt)) if s != own]  # each other source once


_GIVEN = select(Label.key, Label.value).where(
    Label.adapter_id == bindparam("id"), Label.source == "given", Label.key.in_(bindparam("keys", expanding=True))
)
_TESTED = select(Measurement.metric, Measurement.value).where(
    Measurement.adapter_id == bindparam("id"), Measurement.split == "test", Measurement.metric.in_(bindparam("keys", expanding=True))
)


def has_labels(conn: Connection, adapter_id: int, attributes: Mapping[str, str], measurements: Mapping[str, float]) -> bool:
    """Whether the adapter's given labels and test measurements of these keys have these values already (replace_labels
    would change nothing)."""
    for stmt, wanted in ((_GIVEN, attributes), (_TESTED, measurements)):
        if wanted and dict(conn.execute(stmt, {"id": adapter_id, "keys": list(wanted)}).all()) != dict(wanted):
            return False
    return True


def replace_labels(session: Session, adapter_id: int, attributes: Mapping[str, str], measurements: Mapping[str, float]) -> None:
    """Given labels and test measurements replace earlier ones with the same key (new rows: see embed/serving/attributes.py)."""
    if attributes:
        session.execute(delete(Label).where(Label.adapter_id == adapter_id, Label.source == "given", Label.key.in_(attributes)))
        session.add_all(Label(adapter_id=adapter_id, key=k, value=v, source="given") for k, v in attributes.items())
    if measurements:
        session.execute(
            delete(Measurement).where(
                Measurement.adapter_id == adapter_id, Measurement.split == "test", Measurement.metric.in_(measurements)
            )
        )
        session.add_all(Measurement(adapter_id=adapter_id, metric=k, value=v, split="test") for k, v in measurements.items())


def existing_adapter_ids(session: Session, ids: Iterable[int]) -> set[int]:
    """Which of these adapter ids are still stored (the others were deleted since they were read)."""
    ids = list(ids)
    return set(session.scalars(select(Adapter.id).where(Adapter.id.in_(ids)))) if ids else set()


_SPACE_MODULES = (
    select(Module.adapter_id, Module.name, Module.out_features, Module.in_features)
    .join(Adapter, Adapter.id == Module.adapter_id)
    .where(Adapter.base_model == bindparam("base_model"), Adapter.factors_blob.is_not(None))
)


def space_module_shapes(session: Session, base_model: str) -> Iterator[tuple[int, str, int, int]]:
    """(adapter id, module name, out, in) of every module of a base model's stored LoRA-like adapters (those with factors)."""
    for adapter_id, name, out, inp in session.connection().execute(_SPACE_MODULES, {"base_model": base_model}):
        yield int(adapter_id), str(name), int(out), int(inp)
