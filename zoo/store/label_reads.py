"""Given labels and test measurements read in bulk for serving: the query engine's label columns and the map's colours.

Label rows are only ever inserted (a new value of a key replaces the old row by a new one, with a higher id, and ids
are never reused), so a reader that has applied the rows up to an id learns of every change from the rows above it.
"""

from __future__ import annotations

import math

from sqlalchemy import Executable, Integer, bindparam, func, select
from sqlalchemy.orm import Session

from zoo.store.models import Adapter, Label, Measurement

#: (label id, adapter id, key, value)
LabelRow = tuple[int, int, str, str]

_IDS = bindparam("ids", type_=Integer, expanding=True, literal_execute=True)  # rendered inline: no bound-parameter limit
_LABEL_ROW = (Label.id, Label.adapter_id, Label.key, Label.value)
_LABELS_OF = select(*_LABEL_ROW).where(Label.source == "given", Label.adapter_id.in_(_IDS))
_LABELS_AFTER = select(*_LABEL_ROW).where(Label.source == "given", Label.id > bindparam("mark"))
_LAST_LABEL = select(func.max(Label.id))
_LABEL_KEYS = select(Label.key).where(Label.source == "given", Label.adapter_id.in_(_IDS)).distinct()
_METRICS = select(Measurement.metric).where(Measurement.split == "test", Measurement.adapter_id.in_(_IDS)).distinct()
_LABEL_VALUES = select(Label.adapter_id, Label.value).where(
    Label.source == "given", Label.key == bindparam("key"), Label.adapter_id.in_(_IDS)
)
_METRIC_VALUES = select(Measurement.adapter_id, Measurement.value).where(
    Measurement.split == "test", Measurement.metric == bindparam("key"), Measurement.adapter_id.in_(_IDS)
)


def _rows(session: Session, stmt: Executable, params: dict[str, object] | None = None) -> list[LabelRow]:
    return [(int(i), int(a), str(k), str(v)) for i, a, k, v in session.connection().execute(stmt, params)]


def last_label_id(session: Session) -> int:
    """The largest label row id: one index read (every query asks it)."""
    return int(session.connection().execute(_LAST_LABEL).scalar() or 0)


def given_label_rows(session: Session, base_model: str) -> list[LabelRow]:
    """The given label rows of every adapter of a base model: one sequential scan."""
    of_base = select(*_LABEL_ROW).join(Adapter, Adapter.id == Label.adapter_id)
    return _rows(session, of_base.where(Adapter.base_model == base_model, Label.source == "given"))


def given_label_rows_of(session: Session, ids: list[int]) -> list[LabelRow]:
    """The given label rows of these adapters."""
    return _rows(session, _LABELS_OF, {"ids": ids})


def given_label_rows_after(session: Session, mark: int) -> list[LabelRow]:
    """The given label rows written after the row `mark`."""
    return _rows(session, _LABELS_AFTER, {"mark": mark})


def given_label_keys(session: Session, ids: list[int]) -> list[str]:
    """The keys of the given labels of these adapters, sorted."""
    return sorted(session.connection().execute(_LABEL_KEYS, {"ids": ids}).scalars())


def measured_metric_names(session: Session, ids: list[int]) -> list[str]:
    """The metrics measured on the test split of these adapters, sorted."""
    return sorted(session.connection().execute(_METRICS, {"ids": ids}).scalars())


def given_label_values(session: Session, key: str, ids: list[int]) -> dict[int, str]:
    """{id: given label value} of those of these adapters that have the label, in one query."""
    return {i: v for i, v in session.connection().execute(_LABEL_VALUES, {"ids": ids, "key": key})}


def measured_metric_values(session: Session, metric: str, ids: list[int]) -> dict[int, float]:
    """{id: measured test value} of those of these adapters that have a finite one, in one query."""
    rows = session.connection().execute(_METRIC_VALUES, {"ids": ids, "key": metric}).all()
    return {i: float(v) for i, v in rows if v is not None and math.isfinite(v)}
