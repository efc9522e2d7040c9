"""Pair blocks kept past the updates they are of: (U_xᵀU_y, V_xᵀV_y) of two stored adapters' modules, by adapter id.

A `LowRank` keeps its blocks with other updates while both live (zoo/domain/lowrank.py). The relation step holds a
bounded number of adapters (zoo.services.relations.FactorCache) and drops the least recently used, and with them their
blocks; but its neighbourhoods overlap from one adapter to the next (a family's members are each other's neighbours,
and each merge test stacks the same candidates against each other), so the same pairs were made again once their
adapters came back: at Llama-3-8B's widths two thirds of the step's products. A `PairBlocks` keeps the blocks of the
modules of stored adapters (those whose `LowRank` names its adapter and module: `Origin`) by ids, up to a budget of
bytes, the least recently used pairs dropped first. A block comes back as it was made (the same array's values), so a
scan finds what it found with the blocks made again, to the rounding of a product made in another batch's shape.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import numpy as np

#: the share of the relation step's budget (ZOO_EMBED_CHUNK_BYTES) its pair blocks may take besides the adapters it holds:
#: a pair of Llama-3-8B adapters' blocks takes 4 KB a module of rank 16 (an adapter's float64 factors 1.5 MB), so a
#: quarter of the default budget keeps about 32,000 such modules' pairs
BUDGET_SHARE = 0.25


class Origin(NamedTuple):
    """A module of a stored adapter, whose pair blocks `store` keeps: the adapter's id and the module's name."""

    store: PairBlocks
    adapter_id: int
    module: str


class PairBlocks:
    """Blocks of pairs of modules of stored adapters (a pair of one adapter with itself: its self blocks), with their
    inner product once known; each pair of adapters' blocks (every module) dropped together, least recently used first,
    past `budget` bytes."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.held = 0
        #: (lower id, higher id) -> module -> [U_lowᵀU_high, V_lowᵀV_high, ⟨dW_low, dW_high⟩ or None]
        self.pairs: OrderedDict[tuple[int, int], dict[str, list]] = OrderedDict()

    def get(self, x: Origin, y: Origin) -> tuple[np.ndarray, np.ndarray, float | None] | None:
        """(U_xᵀU_y, V_xᵀV_y, inner product or None) of module x with module y (of one name), if kept."""
        key = (x.adapter_id, y.adapter_id) if x.adapter_id <= y.adapter_id else (y.adapter_id, x.adapter_id)
        modules = self.pairs.get(key)
        entry = modules.get(x.module) if modules is not None else None
        if entry is None:
            return None
        self.pairs.move_to_end(key)
        UU, VV, value = entry
        return (UU, VV, value) if key[0] == x.adapter_id else (UU.T, VV.T, value)

    def used(self, ids: list[int]) -> None:
        """The adapters of these ids are in use: the kept pairs among them are the most recently used now (one call for
        the adapters a test reads, not one a module: an SDXL adapter has 418)."""
        held = sorted(set(ids))
        for key in [(a, b) for k, a in enumerate(held) for b in held[k:]]:
            if key in self.pairs:
                self.pairs.move_to_end(key)

    def put(self, x: Origin, y: Origin, UU: np.ndarray, VV: np.ndarray, value: float | None) -> None:
        """Keep module x's blocks with module y (copies: a block may be a view of a larger product), or the inner
        product of blocks kept already."""
        flipped = x.adapter_id > y.adapter_id
        key = (y.adapter_id, x.adapter_id) if flipped else (x.adapter_id, y.adapter_id)
        modules = self.pairs.setdefault(key, {})
        self.pairs.move_to_end(key)
        if (entry := modules.get(x.module)) is not None:
            if value is not None:
                entry[2] = value
            return
        UU, VV = (UU.T, VV.T) if flipped else (UU, VV)
        modules[x.module] = [np.array(UU), np.array(VV), value]
        self.held += UU.nbytes + VV.nbytes
        while self.held > self.budget and len(self.pairs) > 1:
            _, gone = self.pairs.popitem(last=False)
            self.held -= sum(e[0].nbytes + e[1].nbytes for e in gone.values())
