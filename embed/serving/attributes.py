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

from embed.serving.lookup import RowLookup
from zoo.store.label_reads import LabelRow, given_label_rows, given_label_rows_after, given_label_rows_of, last_label_id
from zoo.store.session import Session
from zoo.store.space_adapters import adapter_names, space_adapter_names


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
        rows = space_adapter_names(session, base_model)
        held = np.array([r[0] for r in rows], np.int64)
        keep = np.isin(held, ids)
        attributes.ids = held[keep]
        attributes.names = [r[1] for r, k in zip(rows, keep.tolist(), strict=True) if k]
        attributes._lookup = RowLookup(attributes.ids)
        attributes._apply(given_label_rows(session, base_model))
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
        for start in range(0, len(new), 10_000):  # IN lists stay small
            names = adapter_names(session, new[start : start + 10_000])
            present = [i for i in new[start : start + 10_000] if i in names]
            self.ids = np.concatenate([self.ids, np.asarray(present, np.int64)])
            self.names.extend(names[i] for i in present)
            for column in self.labels.values():
                column.codes = np.concatenate([column.codes, np.full(len(present), -1, np.int32)])
            self._lookup = RowLookup(self.ids)
            if present:
                self._apply(given_label_rows_of(session, present))

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
            self._apply(given_label_rows_after(session, self.mark))
            self.mark = last

    def _apply(self, rows: Sequence[LabelRow]) -> None:
        """Set label values from (label id, adapter id, key, value) rows in id order: the newest wins."""
        rows = sorted(rows, key=lambda r: r[0])  # by label id, the newest last
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
