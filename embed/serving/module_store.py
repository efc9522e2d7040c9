"""The module store: every embedded adapter's canonical factors as one `ModuleStack` per space (`DATA/rerank/`), for the
exact module-cosine stage. `zoo embed` writes it while it fits `module_store_budget()`; the engine holds it as a
`ModuleStore` and grows or shrinks it as adapters are embedded or deleted. Stores written before the derived-file
format are still read (`_legacy_module_store_meta`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from embed.data.types import SpaceSchema
from embed.serving.budgets import embed_chunk_bytes, module_store_budget
from embed.serving.dense_svd import DenseSVD
from embed.serving.search_methods import SKETCH
from zoo.domain.similarity import ModuleStack, dense_modules
from zoo.files import read_derived, write_derived, write_derived_in_place
from zoo.store.embedders import serving_embedders
from zoo.store.embeddings import deleted_since, embedded_ids
from zoo.store.models import EmbeddingSpace
from zoo.store.session import Session
from zoo.store.space_adapters import factor_digests, module_ranks
from zoo.store.spaces import space_version

if TYPE_CHECKING:
    from zoo.domain.canonical import CanonicalFactors
    from zoo.store.blobs import BlobStore


def module_store_path(data_dir: Path, space_id: int) -> Path:
    return data_dir / "rerank" / f"space-{space_id}.safetensors"


def update_module_store(session: Session, blobs: BlobStore, data_dir: Path, space: EmbeddingSpace, rebuild: bool = False) -> str:
    """Write the space's module store (every embedded adapter's factors) while it fits the budget."""
    sketch = serving_embedders(session, space.id).get(SKETCH)
    path = module_store_path(data_dir, space.id)
    if sketch is None:
        return "none (no module sketch embedder)"
    ids = sorted(embedded_ids(session, sketch))
    have = None if rebuild else read_module_store(path)
    dropped = 0
    if have is not None:  # rows of adapters deleted since it was written, or no longer embedded, leave it
        stale = stale_module_rows(session, space.id, have[0], have[3], np.array(ids, np.int64))
        if len(stale):
            keep = np.flatnonzero(~np.isin(have[0], stale))
            have, dropped = (have[0][keep], have[1].take(keep), have[2], have[3]), len(stale)
    known = set(have[0].tolist()) if have else set()
    new = [i for i in ids if i not in known]
    if have and not new and not dropped:
        return "loaded"
    layout = module_layout(session, space.base_model, SpaceSchema.from_dict(sketch.config["schema"]))
    if not layout:  # no stored module of its vocabulary (vectors written without factors): nothing to read
        path.unlink(missing_ok=True)
        return "none (no stored factors of the space's modules: module cosine comes from the module sketches)"
    estimate = len(ids) * layout_bytes(layout)
    if estimate > module_store_budget():  # known from the module table before any factors are read
        path.unlink(missing_ok=True)
        return _over_budget(estimate)
    if have and not set(have[1].norms) <= set(layout):
        have, new = None, ids  # modules the space no longer has: start again
    for name, (U, _, _) in have[1].factors.items() if have else ():
        out, inp, r = layout[name]
        layout[name] = (out, inp, max(r, U.shape[1]))
    dense = have[2] if have else {n for n, (o, i, r) in layout.items() if r and o * i <= 2 * r * (o + i)}
    start = have[1].size if have else 0
    all_ids = np.concatenate([have[0], np.array(new, dtype=np.int64)]) if have else np.array(new, dtype=np.int64)
    per_chunk = max(1, embed_chunk_bytes() // max(layout_bytes(layout), 1))

    def fill(arrays: dict[str, np.ndarray], release: Callable[[], None]) -> None:
        """The store filled in its file a chunk of adapters at a time, each chunk's pages let go once written: `zoo
        embed` holds one chunk, not the store (up to ZOO_MODULE_STORE_BYTES)."""
        nonlocal have
        arrays["ids"][:] = all_ids
        stack = ModuleStack.from_arrays({k: v for k, v in arrays.items() if k != "ids"}, len(all_ids))
        if have:
            have[1].copy_into(stack)
            have = None  # the store read back, let go
            release()
        for at in range(0, len(new), per_chunk):
            stack.fill(start + at, factors_of(session, blobs, new[at : at + per_chunk]))
            release()

    shapes = {**ModuleStack.shapes(len(all_ids), layout, dense), "ids": (len(all_ids),)}
    write_derived_in_place(path, shapes, {"version": space_version(session, space.id), "dense": sorted(dense)}, fill)
    how = "updated" if start else "built"
    return f"{how} ({dropped} deleted dropped)" if dropped else how


def module_layout(session: Session, base_model: str, schema: SpaceSchema) -> dict[str, tuple[int, int, int]]:
    """Per module of the space's vocabulary: (out, in, the largest canonical rank stored), from the module table."""
    known = set(schema.modules)
    return {n: (o, i, r) for n, o, i, r in module_ranks(session, base_model) if (n, o, i) in known}


def layout_bytes(layout: dict[str, tuple[int, int, int]]) -> int:
    """Bytes per adapter of a module store of this layout (ModuleStack's: per module its padded factors, or its
    flattened dW where that is smaller)."""
    elements = 0
    for out, inp, r in layout.values():
        if r:
            elements += 1 + (out * inp if out * inp <= 2 * r * (out + inp) else r * (out + inp + 1))
    return 4 * elements


def stack_bytes(stack: ModuleStack) -> int:
    return sum(a.nbytes for a in stack.arrays().values())


def _over_budget(nbytes: float) -> str:
    return f"none ({nbytes / 2**30:.2f} GiB is over ZOO_MODULE_STORE_BYTES: module cosine comes from the module sketches)"


def factors_of(session: Session, blobs: BlobStore, ids: list[int]) -> list[dict[str, CanonicalFactors]]:
    digests = factor_digests(session, ids)
    return [dict(f) for f in blobs.get_factors_of([str(digests[i]) for i in ids])]


def stack_of(session: Session, blobs: BlobStore, ids: list[int], dense: set[str] | None) -> ModuleStack:
    factors = factors_of(session, blobs, ids)
    return ModuleStack.of(factors, dense if dense is not None else dense_modules(factors))


def write_module_store(path: Path, ids: np.ndarray, stack: ModuleStack, version: int) -> None:
    write_derived(path, {**stack.arrays(), "ids": np.asarray(ids, dtype=np.int64)}, {"version": version, "dense": sorted(stack.dense)})


def stale_module_rows(session: Session, space_id: int, ids: np.ndarray, version: int, embedded: np.ndarray) -> np.ndarray:
    """Ids of a module store written at `version` that it must not serve: adapters deleted since (their tombstones; an
    id is never reused, migration 0011, but a store written before that may hold one) or without a sketch vector now."""
    return ids[np.isin(ids, deleted_since(session, space_id, version)) | ~np.isin(ids, embedded)]


def read_module_store(path: Path) -> tuple[np.ndarray, ModuleStack, set[str], int] | None:
    """(ids, stack, dense modules, version), or None when the file is missing, unreadable or damaged."""
    try:
        tensors, meta = read_derived(path, "module store", legacy=_legacy_module_store_meta)
        ids = tensors.pop("ids")
        return ids, ModuleStack.from_arrays(tensors, len(ids)), set(meta["dense"]), int(meta["version"])
    except Exception:  # noqa: BLE001 - any unreadable file is treated as absent (and rebuilt by `zoo embed`)
        return None


def _legacy_module_store_meta(tensors: dict[str, np.ndarray], raw: dict[str, str]) -> dict | None:
    """The metadata of a module store written before the derived-file format (no checksum; version and dense modules
    as strings). Read so that an upgrade keeps exact re-ranking until the store is next written."""
    try:
        return {"version": int(raw["version"]), "dense": list(json.loads(raw["dense"]))}
    except (KeyError, TypeError, ValueError):
        return None


@dataclass
class ModuleStore:
    """The exact stage's data: factors of the stored adapters, row per id, and the SVDs of their dense modules as
    queries first need them (`svd`, embed/serving/dense_svd.py). Never changed in place: adding or dropping adapters makes a
    new store, which carries the SVDs of the rows it keeps."""

    stack: ModuleStack
    rows: dict[int, int]
    dense: set[str]
    svd: DenseSVD | None = None

    def __post_init__(self) -> None:
        if self.svd is None or self.svd.stack is not self.stack:
            self.svd = DenseSVD(self.stack)

    def take(self, ids: Sequence[int]) -> ModuleStack:
        """The stack of these stored adapters, in that order, with their dense modules' SVDs (`ModuleStack.svd`)."""
        assert self.svd is not None  # set by __post_init__
        return self.svd.take([self.rows[int(i)] for i in ids])

    def extended(self, ids: list[int], stack: ModuleStack) -> ModuleStore:
        start = self.stack.size
        rows = {**self.rows, **{i: start + j for j, i in enumerate(ids)}}
        grown = ModuleStack.concat([self.stack, stack])
        assert self.svd is not None
        source = np.concatenate([np.arange(start), np.full(stack.size, -1)])
        return ModuleStore(grown, rows, self.dense, self.svd.moved(grown, source))

    def without(self, ids: np.ndarray) -> ModuleStore:
        """The store without the rows of these ids (deleted adapters): itself when it holds none of them."""
        gone = {int(i) for i in np.asarray(ids).tolist()} & self.rows.keys()
        if not gone:
            return self
        kept = sorted((row, i) for i, row in self.rows.items() if i not in gone)
        source = np.array([row for row, _ in kept], dtype=np.int64)
        stack = self.stack.take(source)
        assert self.svd is not None
        return ModuleStore(stack, {i: j for j, (_, i) in enumerate(kept)}, self.dense, self.svd.moved(stack, source))
