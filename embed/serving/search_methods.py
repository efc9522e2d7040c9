"""The search methods the engine serves and the embedders (index kinds) each needs for its candidates and scores."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from embed.w2t.checkpoint import channel_metrics_of, checkpoint_meta, gram_reference_of, search_of
from zoo.domain.centred_gram import CENTRED_GRAM, MODULE_CENTRED, REFERENCED, GramReference
from zoo.domain.channel_metric import ChannelMetric
from zoo.domain.exact_scores import EXACT_SCORES, exact_cosines
from zoo.domain.methods import SearchScore, fitted_purpose
from zoo.domain.similarity import ModuleStack
from zoo.errors import NotReadyError

SKETCH = "module_sketch"
W2T = "w2t"
#: the raw-factor sketches (zoo.domain.raw_sketch.raw_sketches): how much two adapters share their factors as their
#: files had them, which the relation step reads for merges PEFT made factor by factor and for continuations
RAW = "raw_factors"
#: the input-Gram sketches (zoo.domain.channels.channel_sketches, "input_gram"): per module seeded bilinear probes of
#: dWᵀdW = V S² Vᵀ, whose inner products estimate the input Gram cosine; the first stage of input_gram search
GRAM = "input_gram_sketch"
#: hybrid: the search score `zoo train` chose out of fold (embed/selection/search_choice.py): an exact score (dw, module or
#: input_gram) mixed with the supervised W2T cosine by the chosen weight (0: the exact score alone), over the union
#: of the CANDIDATES nearest of the indexes it weighs (EXACT_CANDIDATES, W2T); module, dw and input_gram: the
#: CANDIDATES nearest of their sketch indexes ranked by the mean module cosine, the whole update's cosine or the mean
#: input Gram cosine; sketch and w2t: their embeddings alone (their CANDIDATES nearest re-ranked by the stored
#: vectors); raw: the raw-factor sketches alone, for stored adapters.
SEARCH_METHODS = ("hybrid", "module", "dw", "input_gram", "sketch", "w2t", "raw")
#: per method, the embedders it needs (an exact score's candidates are re-ranked from the module store, and the module
#: sketch stands in for its other candidate indexes where the space lacks them: EXACT_CANDIDATES)
METHOD_EMBEDDERS = {"hybrid": (SKETCH, W2T), **dict.fromkeys(EXACT_SCORES, (SKETCH,)), "sketch": (SKETCH,), "w2t": (W2T,), "raw": (RAW,)}
#: per exact score, the indexes whose CANDIDATES nearest are its first-stage candidates, where the space has them (one
#: embedded before the input-Gram sketches has none until `zoo embed` runs):
#: the input Gram's true neighbours (an adapter whose head was re-seeded: dW → Q·dW) need not be near in the module
#: sketch. On digits-vit-seeded (300 adapters, `python -m bench.search --zoo-data-dir`) the CANDIDATES nearest held
#: 0.609 of the exact input-Gram top 10 from the module sketch index, 0.965 from the input-Gram sketch index and 0.988
#: from both (docs/history/results-2026.md)
#: The centred input Gram and its mean with module cosine (served by hybrid only: their reference is `zoo train`'s)
#: take the input Gram's.
EXACT_CANDIDATES = {
    "dw": (SKETCH,),
    "module": (SKETCH,),
    "input_gram": (GRAM, SKETCH),
    CENTRED_GRAM: (GRAM, SKETCH),
    MODULE_CENTRED: (GRAM, SKETCH),
}
#: a channel metric's first-stage candidates (embed/selection/fitted.py): it weighs the input Gram, dW and module cosine as the
#: labels ask, so both indexes' nearest
FITTED_CANDIDATES = (GRAM, SKETCH)
#: the embedder whose vectors each method's own scores are (the others score through exact cosines or the hybrid)
VECTOR_SCORES = {"sketch": SKETCH, "w2t": W2T, "raw": RAW}


@functools.lru_cache(maxsize=64)
def served_search(checkpoint: Path) -> SearchScore:
    """The search score a W2T checkpoint serves as hybrid (its directory is never rewritten, so this is cached)."""
    return search_of(checkpoint_meta(checkpoint))


def stage_kinds(search: SearchScore, have: Mapping[str, object]) -> tuple[str, ...]:
    """The embedders whose indexes give a search score its candidates: those it weighs (its exact score's
    `candidate_kinds`, W2T for its cosine, both for a mix), of those the space has."""
    weight = search.w2t_weight
    exact = candidate_kinds(search.exact, have) if weight < 1 else ()
    return (*exact, W2T) if weight > 0 else exact


def candidate_kinds(score: str, have: Mapping[str, object]) -> tuple[str, ...]:
    """The embedders whose indexes give an exact score its first-stage candidates: exact_sources(score) of those
    the space has (`have`: by method), the module sketch where it has none of them."""
    return tuple(k for k in exact_sources(score) if k in have) or (SKETCH,)


def exact_sources(score: str) -> tuple[str, ...]:
    """The indexes whose nearest are an exact score's first-stage candidates: EXACT_CANDIDATES', or a channel
    metric's FITTED_CANDIDATES."""
    return FITTED_CANDIDATES if fitted_purpose(score) is not None else EXACT_CANDIDATES[score]


def stored_exact(gallery: ModuleStack, query: ModuleStack, score: str, checkpoint: Callable[[], Path]) -> np.ndarray:
    """(gallery.size,) one exact score between a query and stored adapters (module stores' rows): a training-free
    one (zoo.domain.exact_scores), or one that needs what `zoo train` kept in the space's checkpoint (`checkpoint()`,
    read only then): the centred input Gram's reference, a channel metric."""
    if fitted_purpose(score) is not None:
        return served_metric(checkpoint(), score).between(gallery, query)[0]
    reference = served_reference(checkpoint()) if score in REFERENCED else None
    return exact_cosines(gallery, query, score, reference)[0]


def served_reference(checkpoint: Path) -> GramReference:
    """The centred input Gram's reference a W2T checkpoint serves (read once: gram_reference_of is cached)."""
    reference = gram_reference_of(checkpoint)
    if reference is None:
        raise NotReadyError(f"the W2T checkpoint {checkpoint.name} has no centred input Gram reference: run `zoo train` again")
    return reference


@functools.lru_cache(maxsize=64)
def served_metric(checkpoint: Path, name: str) -> ChannelMetric:
    """A channel metric a W2T checkpoint serves, by its score's name (its directory is never rewritten, so this is
    cached)."""
    metrics = channel_metrics_of(checkpoint_meta(checkpoint))
    if name not in metrics:
        raise NotReadyError(f"the W2T checkpoint {checkpoint.name} has no channel metric {name}: run `zoo train` again")
    return metrics[name]
