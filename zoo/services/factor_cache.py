"""The relation step's cache of stored adapters as the detectors read them (zoo/services/relations.py): loaded from the
blob store once each, whole or as the sample of their modules a large query is compared on, within a budget of bytes."""

from __future__ import annotations

from collections import OrderedDict

from zoo.config import RELATION_SAMPLE_BYTES
from zoo.domain.module_sample import sample_modules
from zoo.domain.pair_blocks import BUDGET_SHARE, PairBlocks
from zoo.domain.relations import FactorSummary, Update
from zoo.store.adapters import FactorRow, factor_rows
from zoo.store.blobs import BlobStore
from zoo.store.session import Sessions

#: the modules a query and its candidates are compared on (zoo/domain/module_sample.py), None for all of them
Sample = tuple[str, ...] | None


class FactorCache:
    """Stored adapters as the detectors read them, for one relation step: each adapter's neighbourhood and its
    rechecks', which overlap (a close neighbour's nearest are mostly the adapter's own, and the next adapters' often
    too). Each is loaded from the blob store once (whole, or the sample of its modules a query of its structure is
    compared on: zoo/domain/module_sample.py) and keeps what the detectors computed of it (its float64 modules); past
    `budget` bytes (in `detector_bytes`) the least recently asked for are dropped, never those of the current call.
    A neighbourhood fits the budget (`neighbour_count`); their pair blocks outlive them in BUDGET_SHARE more (`PairBlocks`)."""

    def __init__(self, sessions: Sessions, blobs: BlobStore, budget: int, sample_budget: int | None = None) -> None:
        self.sessions, self.blobs, self.budget = sessions, blobs, budget
        self.sample_budget = RELATION_SAMPLE_BYTES.get() if sample_budget is None else sample_budget
        #: by (adapter id, the modules sampled or None for the whole)
        self.loaded: OrderedDict[tuple[int, Sample], tuple[Update, int]] = OrderedDict()
        self.held, self.pairs = 0, PairBlocks(int(budget * BUDGET_SHARE))
        #: where the factors are of adapters about to be asked for, None for one not stored (`expect`)
        self.rows: dict[int, FactorRow | None] = {}
        #: the modules each adapter asked for as a query is compared on (`query`)
        self.samples: dict[int, Sample] = {}

    def expect(self, ids: list[int]) -> None:
        """Read where the factors of those of `ids` not loaded are, in one query, for the `get`s of a batch (the
        batch before's rows are dropped)."""
        self.rows = {}
        held = {i for i, _ in self.loaded}
        self._read_rows([i for i in dict.fromkeys(ids) if i not in held])

    def _read_rows(self, ids: list[int]) -> None:
        found = factor_rows(self.sessions, ids) if ids else {}
        self.rows.update({i: found.get(i) for i in ids})

    def query(self, adapter_id: int) -> Update | None:
        """The adapter as a query is compared: whole where its modules fit the sample budget (ZOO_RELATION_SAMPLE_BYTES),
        else the sample of them (`samples` keeps which); None if it is no longer stored."""
        if adapter_id not in self.samples:
            held = self.loaded.get((adapter_id, None))
            if held is not None:
                self.samples[adapter_id] = sample_modules(held[0].factors, self.sample_budget)
            else:
                if adapter_id not in self.rows:
                    self._read_rows([adapter_id])
                row = self.rows.get(adapter_id)
                if row is None or not row.blob:
                    return None
                whole = self._update(adapter_id, row)
                names = self.samples[adapter_id] = sample_modules(whole.factors, self.sample_budget)
                if (adapter_id, names) not in self.loaded:  # else held already, as a neighbour of a query of its structure
                    self._hold((adapter_id, names), whole if names is None else whole.sampled(names, _whole_energy(row)))
        found = self.get([adapter_id], self.samples[adapter_id])
        return found[0] if found else None

    def _update(self, adapter_id: int, row: FactorRow) -> Update:
        kept = FactorSummary.from_json(row.summary) if row.summary else None
        return Update(dict(self.blobs.get_factors(str(row.blob))), kept, adapter_id, pairs=self.pairs)

    def _hold(self, key: tuple[int, Sample], update: Update) -> None:
        if key in self.loaded:
            self.held -= self.loaded[key][1]
        self.loaded[key] = (update, detector_bytes(update))
        self.held += self.loaded[key][1]

    def get(self, ids: list[int], sample: Sample = None) -> list[Update]:
        """The updates of these adapters that are still stored, in the order given: whole, or their modules of
        `sample` (a query's, `query`)."""
        keys = [(i, sample) for i in ids]
        missing = [k for k in dict.fromkeys(keys) if k not in self.loaded]
        self._read_rows([i for i, _ in missing if i not in self.rows])
        for i, names in missing:
            row = self.rows.get(i)
            if row is not None and row.blob:
                update = self._update(i, row)
                self._hold((i, names), update if names is None else update.sampled(names, _whole_energy(row)))
        asked = dict.fromkeys(keys)
        for k in asked:  # in the order asked: the first of them is the least recent
            if k in self.loaded:
                self.loaded.move_to_end(k)
        self.pairs.used(list(dict.fromkeys(ids)))
        while self.held > self.budget and next(iter(self.loaded)) not in asked:
            self.held -= self.loaded.popitem(last=False)[1][1]
        return [self.loaded[k][0] for k in keys if k in self.loaded]


def _whole_energy(row: FactorRow) -> float | None:
    """‖dW‖²_F of the whole adapter as stored (read from the database: summing its blob's S would touch every page)."""
    return row.dw_norm**2 if row.dw_norm is not None else None


def detector_bytes(update: Update) -> int:
    """Bytes of an update in the detectors' float64 (its modules, as `Update.modules` makes them)."""
    return 2 * sum(f.U.element_size() * (f.U.numel() + f.S.numel() + f.V.numel()) for f in update.factors.values())
