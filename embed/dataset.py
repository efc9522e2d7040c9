"""Loading an embedding space's adapters from the database and the blob store, whole or as W2T's training set."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from embed.types import SpaceSchema, ZooAdapter
from zoo.domain.channels import EXACT_SCORES
from zoo.domain.similarity import ModuleStack, module_sketches, sketch_module_cosines, sketch_width
from zoo.store.adapters import adapters_with_factors, factor_base_models
from zoo.store.blobs import BlobStore
from zoo.store.session import Session, Sessions

if TYPE_CHECKING:  # torch: only when a training set is read
    from embed.tokens import Batch, TokenSpec
    from embed.train import ExactScores


def load_adapters(session: Session, blobs: BlobStore, base_model: str, ids: list[int] | None = None) -> list[ZooAdapter]:
    """Every stored LoRA-like adapter of a base model (only those `ids`, when given), with its given labels and test measurements."""
    out = []
    for a in adapters_with_factors(session, base_model, ids):
        assert a.factors_blob is not None  # selected for having one
        out.append(
            ZooAdapter(
                id=a.id,
                name=a.name,
                factors=dict(blobs.get_factors(a.factors_blob)),
                labels={lb.key: lb.value for lb in a.labels if lb.source == "given"},
                measurements={m.metric: m.value for m in a.measurements if m.split == "test"},
                source_uri=a.source_uri,
            )
        )
    return out


def base_models(session: Session) -> list[str]:
    return factor_base_models(session)


def given_labels(adapter: ZooAdapter) -> bool:
    """Whether the adapter has any given label or test measurement (a row W2T's out-of-fold choices may score)."""
    return bool(adapter.labels or adapter.measurements)


@dataclass
class TrainingSet:
    """A space's adapters as W2T trains on them: without their factors, as tokens (projected as they were read) and
    the exact scores among the labelled (embed.train.train_w2t takes all three)."""

    adapters: list[ZooAdapter]  # ids, names, labels, measurements; no factors
    tokens: Batch
    exact: ExactScores


def read_training_set(
    sessions: Sessions,
    blobs: BlobStore,
    base_model: str,
    schema: SpaceSchema,
    ids: list[int],
    spec: TokenSpec,
    rank: int,
    per_chunk: int,
    exact_from: tuple[dict[str, tuple[int, int, int]], set[str]] | None,
) -> TrainingSet:
    """The adapters among `ids` that fit the schema, read `per_chunk` at a time: each chunk's factors are tokenized
    (projected) into tokens allocated once for all, and the labelled ones put in a module stack of `exact_from`'s
    (layout, dense modules) or, where it is None, module-sketched; then the chunk is dropped. What is held is the
    tokens, the stack or the sketches, and one chunk."""
    from embed.tokens import allocate, fill, select

    tokens = allocate(len(ids), schema, rank, spec)
    scores = _ExactBuilder(len(ids), schema, exact_from)
    kept: list[ZooAdapter] = []
    for start in range(0, len(ids), per_chunk):
        with sessions() as session:
            chunk = [a for a in load_adapters(session, blobs, base_model, ids[start : start + per_chunk]) if schema.fits(a.factors)]
        scores.add([a for a in chunk if given_labels(a)])
        for a in chunk:
            fill(tokens, len(kept), a, schema, spec)
            kept.append(ZooAdapter(a.id, a.name, {}, a.labels, a.measurements, a.source_uri))
        del chunk
    if len(kept) < len(ids):
        tokens = select(tokens, slice(0, len(kept)))
    return TrainingSet(kept, tokens, scores.done())


class _ExactBuilder:
    """The exact scores among labelled adapters given a chunk at a time: from a module stack (allocated for `capacity`
    rows, filled as they come) or from module sketches (zoo.domain.similarity.module_sketches, as zoo embed makes them)."""

    def __init__(self, capacity: int, schema: SpaceSchema, exact_from: tuple[dict[str, tuple[int, int, int]], set[str]] | None) -> None:
        self.schema = schema
        self.ids: list[int] = []
        self.stack = ModuleStack.allocate(capacity, *exact_from) if exact_from is not None else None
        self.sketches: list[np.ndarray] = []

    def add(self, adapters: list[ZooAdapter]) -> None:
        if not adapters:
            return
        if self.stack is not None:
            self.stack.fill(len(self.ids), [a.factors for a in adapters])
        else:
            names = self.schema.module_names
            self.sketches.append(module_sketches([a.factors for a in adapters], names, sketch_width(len(names))))
        self.ids += [a.id for a in adapters]

    def done(self) -> ExactScores:
        from embed.train import ExactScores

        n, ids = len(self.ids), np.array(self.ids, dtype=np.int64)
        if self.stack is not None:
            s = self.stack  # its first n rows, as views
            factors = {k: (U[:n], V[:n], w[:n]) for k, (U, V, w) in s.factors.items()}
            stack = ModuleStack(n, {k: v[:n] for k, v in s.norms.items()}, {k: v[:n] for k, v in s.dense.items()}, factors)
            return ExactScores.of_stack(ids, stack)
        sketches = np.concatenate(self.sketches) if self.sketches else np.zeros((0, len(self.schema.modules)), np.float32)
        estimate = sketch_module_cosines(sketches, sketches, len(self.schema.modules))
        return ExactScores(ids, dict.fromkeys(EXACT_SCORES, estimate), source="module sketches")
