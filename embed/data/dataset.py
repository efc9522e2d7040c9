"""Loading an embedding space's adapters from the database and the blob store, whole or as W2T's training set."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from embed.data.types import SpaceSchema, ZooAdapter
from embed.selection.fitted import MAX_LABELLED
from zoo.domain.centred_gram import REFERENCED, GramReference, fit_gram_reference, reference_sample
from zoo.domain.channel_metric import Bank, bank_matrices
from zoo.domain.exact_scores import EXACT_SCORES, exact_matrices
from zoo.domain.similarity import ModuleStack, dense_modules, module_sketches, sketch_module_cosines, sketch_width
from zoo.domain.sizes import PROFILE, update_profile
from zoo.store.adapters import adapters_with_factors, factor_base_models
from zoo.store.blobs import BlobStore
from zoo.store.session import Session, Sessions

if TYPE_CHECKING:  # torch: only when a training set is read
    from embed.data.tokens import Batch, TokenSpec


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
class ExactScores:
    """The exact scores (zoo.domain.exact_scores.EXACT_SCORES, and from factors the centred input Gram's:
    REFERENCED) among some training adapters, by id: what the out-of-fold choices compare W2T with. `source` says
    what they were computed from: "factors" (exact), or "module sketches" where the space is too big for the engine's
    module store, whose module-cosine estimate then stands in for the training-free scores when a query is served
    (embed.serving.engine) and so here. `bank`: the channel metric's atoms among them
    (zoo.domain.channel_metric.bank_matrices), from the factors, where they are at most
    embed.selection.fitted.MAX_LABELLED."""

    ids: np.ndarray
    scores: dict[str, np.ndarray]
    source: str = "factors"
    bank: Bank | None = None
    #: the centred input Gram's reference, fitted on a sample of the space's adapters (zoo/domain/centred_gram.py
    #: reference_sample), whose scores are among `scores` where it is (from the factors)
    gram_reference: GramReference | None = None
    #: each one's update profile (zoo.domain.sizes.update_profile, a row each), where it was read with its factors
    profiles: np.ndarray | None = None

    def _at(self, ids: list[int]) -> np.ndarray:
        at = {int(i): j for j, i in enumerate(self.ids.tolist())}
        return np.array([at[int(i)] for i in ids], dtype=np.int64)

    def among(self, ids: list[int]) -> dict[str, np.ndarray]:
        idx = self._at(ids)
        return {k: v[np.ix_(idx, idx)] for k, v in self.scores.items()}

    def profiles_among(self, ids: list[int]) -> np.ndarray:
        """The update profiles of `ids`, a row each in that order (none where they are not known)."""
        return self.profiles[self._at(ids)] if self.profiles is not None else np.zeros((0, len(PROFILE)))

    def bank_among(self, ids: list[int]) -> Bank | None:
        idx = self._at(ids)
        return self.bank.take(idx, idx) if self.bank is not None else None

    @classmethod
    def of_stack(
        cls, ids: np.ndarray, stack: ModuleStack, profiles: np.ndarray, reference: GramReference, bank: bool = True
    ) -> ExactScores:
        """Exact scores among the adapters of a stack (their update `profiles` a row each, read from their factors; the
        centred input Gram's by `reference`), and with `bank` the channel metric's atoms where they are few enough."""
        atoms = bank_matrices(stack, stack) if bank and stack.size <= MAX_LABELLED else None
        scores = exact_matrices(stack, stack, (*EXACT_SCORES, *REFERENCED), reference)
        return cls(ids, scores, bank=atoms, gram_reference=reference, profiles=profiles)

    @classmethod
    def of_factors(cls, adapters: list[ZooAdapter], bank: bool = True, space: list[ZooAdapter] | None = None) -> ExactScores:
        """Exact scores (and with `bank` the atoms: of_stack) among adapters held with their full factors, the centred
        input Gram's reference fitted on the reference_sample of `space` (the space's adapters, labelled or not, with
        their factors; by default `adapters`)."""
        factors = [a.factors for a in adapters]
        stack = ModuleStack.of(factors, dense_modules(factors))
        pool = space if space is not None else adapters
        by_id = {a.id: a for a in pool}
        sample = [by_id[i].factors for i in reference_sample([a.id for a in pool])]
        reference = fit_gram_reference(ModuleStack.of(sample, dense_modules(sample)), np.arange(len(sample)))
        return cls.of_stack(np.array([a.id for a in adapters], dtype=np.int64), stack, profiles_of(adapters), reference, bank)


@dataclass
class TrainingSet:
    """A space's adapters as W2T trains on them: without their factors, as tokens (projected as they were read) and
    the exact scores among the labelled (embed.training.train.train_w2t takes all three)."""

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
    (layout, dense modules), with the centred input Gram's reference sample (reference_sample, labelled or not) in
    one of their own, or, where it is None, module-sketched; then the chunk is dropped. What is held is the tokens, the
    stacks or the sketches, and one chunk."""
    from embed.data.tokens import allocate, fill, select

    tokens = allocate(len(ids), schema, rank, spec)
    scores = _ExactBuilder(len(ids), schema, exact_from, reference_sample(ids))
    kept: list[ZooAdapter] = []
    for start in range(0, len(ids), per_chunk):
        with sessions() as session:
            chunk = [a for a in load_adapters(session, blobs, base_model, ids[start : start + per_chunk]) if schema.fits(a.factors)]
        scores.add([a for a in chunk if given_labels(a)])
        scores.add_reference(chunk)
        for a in chunk:
            fill(tokens, len(kept), a, schema, spec)
            kept.append(ZooAdapter(a.id, a.name, {}, a.labels, a.measurements, a.source_uri))
        del chunk
    if len(kept) < len(ids):
        tokens = select(tokens, slice(0, len(kept)))
    return TrainingSet(kept, tokens, scores.done())


class _ExactBuilder:
    """The exact scores among labelled adapters given a chunk at a time: from a module stack (allocated for `capacity`
    rows, filled as they come; the centred input Gram's reference from a stack of the adapters of `sample`, labelled or
    not) or from module sketches (zoo.domain.similarity.module_sketches, as zoo embed makes them)."""

    def __init__(
        self, capacity: int, schema: SpaceSchema, exact_from: tuple[dict[str, tuple[int, int, int]], set[str]] | None, sample: list[int]
    ) -> None:
        self.schema = schema
        self.ids: list[int] = []
        self.stack = ModuleStack.allocate(capacity, *exact_from) if exact_from is not None else None
        self.sample = set(sample)
        self.reference_stack = ModuleStack.allocate(len(sample), *exact_from) if exact_from is not None else None
        self.reference_rows = 0
        self.sketches: list[np.ndarray] = []
        self.profiles: list[np.ndarray] = []

    def add(self, adapters: list[ZooAdapter]) -> None:
        if not adapters:
            return
        if self.stack is not None:
            self.stack.fill(len(self.ids), [a.factors for a in adapters])
        else:
            names = self.schema.module_names
            self.sketches.append(module_sketches([a.factors for a in adapters], names, sketch_width(len(names))))
        self.profiles.append(profiles_of(adapters))
        self.ids += [a.id for a in adapters]

    def add_reference(self, adapters: list[ZooAdapter]) -> None:
        """Those of `adapters` in the reference sample, into the reference's stack (nothing without one)."""
        picked = [a.factors for a in adapters if a.id in self.sample]
        if self.reference_stack is not None and picked:
            self.reference_stack.fill(self.reference_rows, picked)
            self.reference_rows += len(picked)

    def done(self) -> ExactScores:
        n, ids = len(self.ids), np.array(self.ids, dtype=np.int64)
        if self.stack is not None and self.reference_stack is not None:
            reference = fit_gram_reference(_first_rows(self.reference_stack, self.reference_rows), np.arange(self.reference_rows))
            return ExactScores.of_stack(ids, _first_rows(self.stack, n), self._profiles(), reference)
        sketches = np.concatenate(self.sketches) if self.sketches else np.zeros((0, len(self.schema.modules)), np.float32)
        estimate = sketch_module_cosines(sketches, sketches, len(self.schema.modules))
        return ExactScores(ids, dict.fromkeys(EXACT_SCORES, estimate), source="module sketches", profiles=self._profiles())

    def _profiles(self) -> np.ndarray:
        return np.concatenate(self.profiles) if self.profiles else np.zeros((0, len(PROFILE)))


def _first_rows(stack: ModuleStack, n: int) -> ModuleStack:
    """A stack's first n rows, as views."""
    factors = {k: (U[:n], V[:n], w[:n]) for k, (U, V, w) in stack.factors.items()}
    return ModuleStack(n, {k: v[:n] for k, v in stack.norms.items()}, {k: v[:n] for k, v in stack.dense.items()}, factors)


def profiles_of(adapters: list[ZooAdapter]) -> np.ndarray:
    """The adapters' update profiles (zoo.domain.sizes.update_profile), a row each."""
    return np.array([update_profile(f.S for f in a.factors.values()) for a in adapters]).reshape(len(adapters), len(PROFILE))
