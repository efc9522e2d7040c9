"""What a query is about and what the query engine answers: a search's hits, a prediction's classes and metrics."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from zoo.errors import NotFoundError

if TYPE_CHECKING:
    from zoo.domain.canonical import CanonicalFactors


@dataclass
class Query:
    """What a search is about: a stored adapter (its id) or adapter read from a file (its factors)."""

    name: str
    adapter_id: int | None = None
    factors_loader: Callable[[], dict[str, CanonicalFactors]] | None = None

    @functools.cached_property
    def factors(self) -> dict[str, CanonicalFactors]:
        if self.factors_loader is None:
            raise NotFoundError(f"adapter {self.adapter_id} has no stored factors")
        return self.factors_loader()


#: a neighbour of a stored adapter: (its id, its score)
Neighbour = tuple[int, float]


class Hit(TypedDict):
    """One adapter found by a search."""

    adapter_id: int
    name: str
    score: float
    labels: dict[str, str]


class Found(TypedDict):
    """What `QueryEngine.similar` finds."""

    space: str
    method: str
    embedder_ids: list[int]
    module_stage: str | None
    index_states: dict[str, str]
    results: list[Hit]


class ClassGuess(TypedDict):
    """One of an attribute's likeliest classes."""

    value: str
    probability: float
    neighbours: int  # labelled neighbours of the query with this class


class Confidence(TypedDict):
    """How far an attribute's prediction can be trusted, and how it stands to the value given for the adapter."""

    sure: bool
    neighbours: int
    agreeing: int
    calibrated: bool
    given: str | None  # the adapter's given value (a stored adapter, or a file that is one)
    agrees: bool | None  # whether the top class is the given value (None: none given)


class MetricGuess(TypedDict):
    """A metric's predicted value with its 90 % interval (None without held-out residuals)."""

    value: float
    low: float | None
    high: float | None
    interval: float | None
    predictor: str
    method: str
    measured: float | None  # the adapter's measured value (a stored adapter, or a file that is one)
    within: bool | None  # whether the measured value lies in the interval (None: none measured, or no interval)


class Predicted(TypedDict):
    """What `QueryEngine.predict` predicts."""

    space: str
    embedder_id: int
    attributes: dict[str, list[ClassGuess]]
    confidence: dict[str, Confidence]
    metrics: dict[str, MetricGuess]
    predictors: dict[str, str]
    search: str
    choices: dict[str, dict[str, object]]
