"""The one label write: an adapter's given labels and test measurements, with its search document, under one lock.

Every writer of a stored adapter's labels goes through `write_labels` (the API's `PUT /adapters/{id}/labels`, and
ingest when a duplicate brings labels), so two writers of one adapter's labels are serialized on PostgreSQL by the
same advisory lock, `label_lock(adapter_id)`, whoever they are; SQLite has one writer at a time anyway.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

from sqlalchemy import select
from sqlalchemy.orm import Session

from zoo.store.catalog import refresh_search_text
from zoo.store.locks import label_lock, take_locks
from zoo.store.models import Label, Measurement
from zoo.store.repository import replace_labels


class AdapterLabels(TypedDict):
    """An adapter's given labels and test measurements (what `PUT /adapters/{id}/labels` answers)."""

    id: int
    labels: dict[str, str]
    measurements: dict[str, float]


def write_labels(session: Session, adapter_id: int, attributes: Mapping[str, str], measurements: Mapping[str, float]) -> None:
    """Given labels and test measurements replace those with the same key, and the search document is rewritten, in the
    session's write transaction (zoo.store.session.write_transaction), under `label_lock(adapter_id)`: taken here when the
    transaction does not hold it yet, and held to its end."""
    take_locks(session, label_lock(adapter_id))
    replace_labels(session, adapter_id, attributes, measurements)
    session.flush()
    refresh_search_text(session, [adapter_id])


def given_labels(session: Session, adapter_id: int) -> tuple[dict[str, str], dict[str, float]]:
    """An adapter's given labels and test measurements, in two indexed look-ups (what a prediction is set beside)."""
    conn = session.connection()
    labels = conn.execute(select(Label.key, Label.value).where(Label.adapter_id == adapter_id, Label.source == "given"))
    measured = conn.execute(
        select(Measurement.metric, Measurement.value).where(Measurement.adapter_id == adapter_id, Measurement.split == "test")
    )
    return {str(k): str(v) for k, v in labels}, {str(k): float(v) for k, v in measured}
