"""The one label write: an adapter's given labels and test measurements, with its search document, under one lock.

Every writer of a stored adapter's labels goes through `write_labels` (the API's `PUT /adapters/{id}/labels`, and
ingest when a duplicate brings labels), so two writers of one adapter's labels are serialized on PostgreSQL by the
same advisory lock, `label_lock(adapter_id)`, whoever they are; SQLite has one writer at a time anyway.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from zoo.labels import check_label_limits
from zoo.store.locks import label_lock, take_locks
from zoo.store.models import CatalogChange, Label, Measurement
from zoo.store.repository import replace_labels
from zoo.store.search_text import refresh_search_text


class AdapterLabels(TypedDict):
    """An adapter's given labels and test measurements (what `PUT /adapters/{id}/labels` answers)."""

    id: int
    labels: dict[str, str]
    measurements: dict[str, float]


def write_labels(session: Session, adapter_id: int, attributes: Mapping[str, str], measurements: Mapping[str, float]) -> None:
    """Given labels and test measurements replace those with the same key, and the search document is rewritten, in the
    session's write transaction (zoo.store.session.write_transaction), under `label_lock(adapter_id)`: taken here when the
    transaction does not hold it yet, and held to its end. LabelLimitError, before anything is written, when the labels the
    adapter would have are past a limit (zoo.labels.label_problem)."""
    take_locks(session, label_lock(adapter_id))
    stored_labels, stored_measurements = given_labels(session, adapter_id)
    check_label_limits({**stored_labels, **attributes}, {**stored_measurements, **measurements})
    replace_labels(session, adapter_id, attributes, measurements)
    session.flush()
    refresh_search_text(session, [adapter_id])


def remove_label(session: Session, adapter_id: int, key: str) -> bool:
    """Remove the adapter's given label `key` and its test measurement `key`, and rewrite its search document, as
    write_labels does (in the session's write transaction, under the adapter's label lock); whether either was there.
    A removed label leaves a CatalogChange row, which moves the catalog's mark as a new label row would."""
    take_locks(session, label_lock(adapter_id))
    labels = session.execute(delete(Label).where(Label.adapter_id == adapter_id, Label.source == "given", Label.key == key))
    measured = session.execute(
        delete(Measurement).where(Measurement.adapter_id == adapter_id, Measurement.split == "test", Measurement.metric == key)
    )
    removed = bool(labels.rowcount or measured.rowcount)  # type: ignore[attr-defined]
    if removed:
        session.add(CatalogChange(adapter_id=adapter_id, what="label removed"))
        session.flush()
        refresh_search_text(session, [adapter_id])
    return removed


def given_labels(session: Session, adapter_id: int) -> tuple[dict[str, str], dict[str, float]]:
    """An adapter's given labels and test measurements, in two indexed look-ups (what a prediction is set beside)."""
    conn = session.connection()
    labels = conn.execute(select(Label.key, Label.value).where(Label.adapter_id == adapter_id, Label.source == "given"))
    measured = conn.execute(
        select(Measurement.metric, Measurement.value).where(Measurement.adapter_id == adapter_id, Measurement.split == "test")
    )
    return {str(k): str(v) for k, v in labels}, {str(k): float(v) for k, v in measured}
