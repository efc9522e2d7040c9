"""Names and given labels of a space's adapters, held in memory by the query engine.

A query's hits get their names and labels, and a label filter its allowed ids, from here, never
from disk: at a million adapters each hit read from the database is a random page, and pages not
touched for a while are not in memory. Per row: the name, and per label key a value code (int32,
-1 when the adapter has no such label), so a filter is one vectorized comparison.

It stays current cheaply: label rows are only ever inserted (a new value of a key replaces the old
row by a new one, with a higher id), so the engine asks for the largest label id per request and,
when it moved, reads only the rows above the one it has seen (label ids are never reused: migration
0011). New adapters come with their embeddings; the engine adds them with `add`, and drops deleted ones
(their tombstones) with `drop`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from sqlalchemy import Row, bindparam, func, select
from sqlalchemy.orm import Session

from embed.lookup import RowLookup
from zoo.store.models import Adapter, Label


@dataclass
class LabelColumn:
    codes: np.ndarray  # int32 per row, -1: none
    values: list[str] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)

    def code(self, value: str) -> int:
        if value not in self.index:
            self.index[value] = len(self.values)
            self.values.append(value)
        return self.index[value]


_NAMES = select(Adapter.id, Adapter.name).where(Adapter.id.in_(bindparam("ids", expanding=True)))
_LABELS_OF = select(Label.id, Label.adapter_id, Label.key, Label.value).where(
    Label.source == "given", Label.adapter_id.in_(bindparam("ids", expanding=True))
)
_LABELS_AFTER = select(Label.id, Label.adapter_id, Label.key, Label.value).where(Label.source == "given", Label.id > bindparam("mark"))
_LAST_LABEL = select(func.max(Label.id))


def last_label_id(session: Session) -> int:
    """The largest label row id: one index read (every query asks it)."""
    return int(session.connection().execute(_LAST_LABEL).scalar() or 0)


class AdapterAttributes:
    """Names and given labels by adapter id (rows appended as adapters arrive, looked up by sorted id)."""

    def __init__(self, mark: int = 0) -> None:
        self.ids = np.zeros(0, np.int64)
        self.names: list[str] = []
        self.labels: dict[str, LabelColumn] = {}
        self.mark = mark  # label rows up to this id are applied
        self._lookup = RowLookup(self.ids)

    @classmethod
    def load(cls, session: Session, base_model: str, ids: np.ndarray) -> AdapterAttributes:
        """The attributes of these adapters of one base model, read in two sequential scans (not by id);
        the mark is read first, so a label written meanwhile is applied by `refresh`."""
        attributes = cls(last_label_id(session))
        conn = session.connection()
        rows = conn.execute(select(Adapter.id, Adapter.name).where(Adapter.base_model == base_model).order_by(Adapter.id)).all()
        held = np.array([r[0] for r in rows], np.int64)
        keep = np.isin(held, ids)
        attributes.ids = held[keep]
        attributes.names = [r[1] for r, k in zip(rows, keep.tolist(), strict=True) if k]
        attributes._lookup = RowLookup(attributes.ids)
        stmt = (
            select(Label.id, Label.adapter_id, Label.key, Label.value)
            .join(Adapter, Adapter.id == Label.adapter_id)
            .where(Adapter.base_model == base_model, Label.source == "given")
        )
        attributes._apply(conn.execute(stmt).all())
        return attributes

    def __len__(self) -> int:
        return len(self.names)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows of these ids, -1 where absent."""
        return self._lookup(ids)

    def add(self, session: Session, ids: list[int]) -> None:
        """Load the names and current labels of the adapters not held yet (the mark stays: see refresh)."""
        wanted = np.unique(np.asarray(ids, np.int64))
        new = wanted[self.rows(wanted) < 0].tolist()
        conn = session.connection()
        for start in range(0, len(new), 10_000):  # IN lists stay small
            names = dict(conn.execute(_NAMES, {"ids": new[start : start + 10_000]}).all())
            present = [i for i in new[start : start + 10_000] if i in names]
            self.ids = np.concatenate([self.ids, np.asarray(present, np.int64)])
            self.names.extend(names[i] for i in present)
            for column in self.labels.values():
                column.codes = np.concatenate([column.codes, np.full(len(present), -1, np.int32)])
            self._lookup = RowLookup(self.ids)
            if present:
                self._apply(conn.execute(_LABELS_OF, {"ids": present}).all())

    def drop(self, ids: np.ndarray) -> None:
        """Forget these adapters (deleted): their names and labels leave every lookup and filter."""
        gone = np.isin(self.ids, np.asarray(ids, np.int64))
        if not gone.any():
            return
        keep = ~gone
        self.ids = self.ids[keep]
        self.names = [n for n, k in zip(self.names, keep.tolist(), strict=True) if k]
        for column in self.labels.values():
            column.codes = column.codes[keep]
        self._lookup = RowLookup(self.ids)

    def refresh(self, session: Session) -> None:
        """Apply the label rows written since the mark (one index read when none were)."""
        last = last_label_id(session)
        if last != self.mark:
            self._apply(session.connection().execute(_LABELS_AFTER, {"mark": self.mark}).all())
            self.mark = last

    def _apply(self, rows: Sequence[Row[int, int, str, str]]) -> None:
        """Set label values from (label id, adapter id, key, value) rows in id order: the newest wins."""
        rows = sorted(rows, key=lambda r: r[0])  # by label id: ints compare fast, SQLAlchemy rows do not (2 s per 100k)
        where = self.rows(np.array([r[1] for r in rows], np.int64)).tolist() if rows else []
        for (_, _, key, value), row in zip(rows, where, strict=True):
            if row < 0:
                continue  # not in this space (yet): its labels come with it
            column = self.labels.get(key)
            if column is None:
                column = self.labels[key] = LabelColumn(np.full(len(self.names), -1, np.int32))
            column.codes[row] = column.code(value)

    def name_and_labels(self, adapter_id: int) -> tuple[str, dict[str, str]]:
        row = int(self.rows(np.array([adapter_id], np.int64))[0])
        if row < 0:
            return "?", {}
        return self.names[row], {k: c.values[c.codes[row]] for k, c in self.labels.items() if c.codes[row] >= 0}

    def with_label(self, key: str, value: str) -> np.ndarray:
        """Ids of the adapters whose given label `key` is `value`."""
        column = self.labels.get(key)
        if column is None or value not in column.index:
            return np.zeros(0, np.int64)
        return self.ids[column.codes == column.index[value]]
