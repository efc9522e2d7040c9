"""What the engine holds of a loaded space (its embedders' indexes, module store, names and labels), the memory that
takes, and the W2T models loaded once per process."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from embed.data.types import SpaceSchema
from embed.serving.attributes import AdapterAttributes
from embed.serving.dense_svd import DenseSVD
from embed.serving.index import AdapterIndex
from embed.serving.module_store import ModuleStore, stack_bytes
from embed.serving.rwlock import RWLock
from embed.serving.search_methods import GRAM, RAW, SKETCH, W2T, exact_sources
from zoo.store import repository
from zoo.store.filters import label_key
from zoo.store.session import Session

if TYPE_CHECKING:
    from embed.w2t.ensemble import W2TEnsemble


@dataclass
class LoadedEmbedder:
    id: int
    method: str
    objective: str | None
    checkpoint: str | None
    config: dict
    index: AdapterIndex
    state: str  # loaded | answered from the database (...)


#: the indexes a space opens the first time a query needs one, not when it loads: only `--method raw` and the relation
#: step's neighbours read the raw-factor sketches, whose fast-scan codes are the largest in memory (SDXL's at a million:
#: 0.35 GB)
DEFERRED = (RAW,)


@dataclass
class SpaceState:
    id: int
    name: str
    base_model: str
    version: int
    embedders: dict[str, LoadedEmbedder]
    modules: ModuleStore | None
    attributes: AdapterAttributes
    lock: RWLock = field(default_factory=RWLock)
    #: the active embedders whose index is not opened yet (DEFERRED), id by kind
    deferred: dict[str, int] = field(default_factory=dict)

    @property
    def active(self) -> dict[str, int]:
        """The active embedders' ids by kind, opened or deferred."""
        return {**self.deferred, **{kind: e.id for kind, e in self.embedders.items()}}

    @property
    def schema(self) -> SpaceSchema | None:
        sketch = self.embedders.get(SKETCH)
        return SpaceSchema.from_dict(sketch.config["schema"]) if sketch else None

    @property
    def default_method(self) -> str:
        w2t = self.embedders.get(W2T)
        return "hybrid" if w2t is not None and w2t.objective != "contrastive" else "module"

    def missing(self, exact: str | None) -> dict[str, str]:
        """The indexes that would give an exact score candidates that the space lacks, each with what stands in."""
        wanted = exact_sources(exact) if exact is not None else ()
        return {
            kind: f"not built: candidates from the {SKETCH} index instead; run `zoo embed --space {self.name}`"
            for kind in wanted
            if kind not in self.active
        }

    def module_stage(self, exact: str | None) -> str:
        """What an exact score is computed from: the module store, else the sketches that estimate it (the engine's `_exact`)."""
        if self.modules is not None:
            return "exact (module store)"
        return (
            "input-Gram sketches (no module store)"
            if exact == "input_gram" and GRAM in self.embedders
            else "module sketches (no module store)"
        )


#: bytes per held adapter besides its vectors: an index's id and row lookup; a module store's row (a dict entry);
#: a name (a short str) and its row lookup
ID_BYTES, ROW_BYTES, NAME_BYTES = 16, 100, 112


def space_bytes(state: SpaceState) -> int:
    """The memory a loaded space holds, estimated from its parts: each index's vectors, the module store's arrays,
    rows and the most its dense modules' SVDs can take (DenseSVD.bound), the names and a label code per adapter and
    key. W2T models are held per process (`load_w2t`)."""
    total = sum(index_bytes(e.index) for e in state.embedders.values())
    if state.modules is not None:
        total += stack_bytes(state.modules.stack) + DenseSVD.bound(state.modules.stack) + ROW_BYTES * len(state.modules.rows)
    attributes = state.attributes
    return total + len(attributes) * (NAME_BYTES + 4 * len(attributes.labels))


def index_bytes(index: AdapterIndex) -> int:
    """An index's vectors: float32 in a flat one; in an IVF one the store (8-bit or float16), the list codes (float16 or
    4-bit PQ) and the 8-bit subset codes (embed/serving/index.py)."""
    if not index.ivf:
        return index.size * (index.store_bytes + ID_BYTES)
    codes = 2 * index.dim if index.codes == "fp16" else index.dim // 8
    return index.size * (index.store_bytes + codes + index.dim // 8 + ID_BYTES)


@functools.lru_cache(maxsize=4)
def load_w2t(checkpoint: Path, device: str | None) -> W2TEnsemble:
    """A W2T checkpoint, loaded once per process (checkpoint directories are never rewritten)."""
    from embed.w2t.ensemble import W2TEnsemble

    return W2TEnsemble.load(checkpoint, device)


def allowed_ids(session: Session, state: SpaceState, filters: Mapping[str, str]) -> np.ndarray:
    """Ids of the space's adapters that the filters keep, sorted: labels from memory (`label.rank` the label rank),
    adapter columns (base_model, format, rank, source) in SQL."""
    columns = {k: v for k, v in filters.items() if k in repository.COLUMN_FILTERS}
    allowed = np.array(repository.filter_adapter_ids(session, state.base_model, columns), np.int64) if columns else None
    for key, value in filters.items():
        if key not in repository.COLUMN_FILTERS:
            ids = state.attributes.with_label(label_key(key), value)
            allowed = ids if allowed is None else np.intersect1d(allowed, ids, assume_unique=True)
    assert allowed is not None  # called with filters only, each of which narrowed it
    return np.sort(allowed)
