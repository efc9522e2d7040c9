"""The methods `zoo train` chooses among (embed/selection/choice.py), as values: a search score and a target's predictor.

Their names (`dw`, `module+w2t@0.3`, `w2t`, `module+w2t@0.8 then top 10 by module+w2t@0.1`; `knn dw k=3`, `head`)
are what checkpoints, the JSON of `zoo train`, `zoo eval` and `zoo predict`, and the REST API carry: `name` writes
one, `parse` reads one back (a ValueError for anything `name` does not write), and each value has one name.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, TypeAlias

import numpy as np

from zoo.domain.centred_gram import REFERENCED
from zoo.domain.exact_scores import EXACT_SCORES
from zoo.domain.similarity import hybrid_score, rerank_keys

#: a fitted score's name: this and its purpose ("search" or a target), e.g. `metric:search`, `metric:task`
FITTED = "metric:"
#: a fused score's name: this and the purpose of the channel metric it fuses with dW, e.g. `fused:search`
FUSED = "fused:"
_W2T = "w2t"
_MIX = "+w2t@"
_THEN = " then top "
_BY = " by "
_KNN = "knn "
_K = " k="
_T = " T="
_H = " h="
_TREND = " trend"
#: the most adapters a second stage re-ranks
MAX_RERANK_TOP = 100


def fitted_score(purpose: str) -> str:
    """The name of the few-label channel metric fitted for `purpose` (zoo/domain/channel_metric.py): "search", or a
    target (an attribute, fitted as the task kNN's, or a metric, as the performance kNN's)."""
    return f"{FITTED}{purpose}"


def fused_score(purpose: str) -> str:
    """The name of the per-query fusion of the whole update's dW cosine with the channel metric fitted for `purpose`
    (zoo/domain/fusion.py), e.g. `fused:search`."""
    return f"{FUSED}{purpose}"


def fitted_purpose(score: str) -> str | None:
    """The purpose of a score the labels shaped: a channel metric (`fitted_score`) or its fusion with dW
    (`fused_score`); None for a training-free exact score."""
    for prefix in (FITTED, FUSED):
        if score.startswith(prefix):
            return score.removeprefix(prefix) or None
    return None


def fitted_by_training(score: str) -> bool:
    """Whether a score needs what `zoo train` fitted and keeps in its checkpoint: the centred input Gram's reference,
    a channel metric or its fusion with dW."""
    return score in REFERENCED or fitted_purpose(score) is not None


def fusion_of(score: str) -> str | None:
    """The fused score (`fused_score`) of a channel metric's name (`fitted_score`); None for any other score."""
    purpose = fitted_purpose(score) if score.startswith(FITTED) else None
    return None if purpose is None else fused_score(purpose)


def fused_metric(score: str) -> str | None:
    """The channel metric a fused score (`fused_score`) weighs beside dW, by its score's name; None for any other."""
    purpose = fitted_purpose(score) if score.startswith(FUSED) else None
    return None if purpose is None else fitted_score(purpose)


def _writable(weight: float) -> bool:
    """A W2T weight in [0, 1] that a name writes exactly (`:g`, six significant digits)."""
    return 0 <= weight <= 1 and float(f"{weight:g}") == weight


@dataclass(frozen=True)
class SearchScore:
    """An exact score (zoo.domain.channels.EXACT_SCORES, the centred input Gram on the reference `zoo train` fitted:
    CENTRED_GRAM, a channel metric fitted on the labelled adapters for a purpose: `fitted_score`, or its fusion with
    dW: `fused_score`) mixed with the supervised W2T cosine at `w2t_weight`:
    0 the exact score alone, 1 the W2T cosine alone (which mixes in no exact score: its `exact` is always the first).
    A weight is one its name writes exactly (`:g`, six significant digits).

    With a second stage (`rerank_weight`), the `rerank_top` best by that mix are re-ordered by a second mix, and the
    rest follow in the first stage's order. The second mix is the same exact score at `rerank_weight`, below
    `w2t_weight` (the W2T-heavy mix finds, the lighter one orders what it found); or (`rerank_exact`) for a channel
    metric's first stage, that metric fused with dW (`fused_score`) at the same weight: the metric finds, and the
    fusion puts first a neighbour that stands out in dW (zoo/domain/fusion.py)."""

    exact: str = EXACT_SCORES[0]
    w2t_weight: float = 0.0
    rerank_weight: float | None = None
    rerank_top: int = 10
    rerank_exact: str | None = None

    def __post_init__(self) -> None:
        weight = float(self.w2t_weight)
        if (self.exact not in (*EXACT_SCORES, *REFERENCED) and fitted_purpose(self.exact) is None) or not _writable(weight):
            raise ValueError(f"no search score mixes exact score {self.exact!r} with the W2T cosine at {self.w2t_weight!r}")
        object.__setattr__(self, "w2t_weight", weight)
        if self.rerank_exact == self.exact:
            object.__setattr__(self, "rerank_exact", None)
        if self.rerank_weight is not None:
            second = float(self.rerank_weight)
            top = self.rerank_top
            fused = self.rerank_exact is not None
            if (
                not _writable(second)
                or not (second == weight < 1 if fused else second < weight < 1)
                or (fused and self.rerank_exact != fusion_of(self.exact))
                or isinstance(top, bool)
                or not isinstance(top, int)
                or not 2 <= top <= MAX_RERANK_TOP
            ):
                by = f"{self.rerank_exact} at " if fused else ""
                raise ValueError(
                    f"no second stage re-ranks the top {top!r} of {self.exact}{_MIX}{weight:g} by {by}the W2T weight "
                    f"{self.rerank_weight!r}: it needs the same exact score at a lighter W2T weight than the first stage's (which "
                    f"must be below 1), or a channel metric's fusion with dW at its own weight, and a top of 2 to {MAX_RERANK_TOP}"
                )
            object.__setattr__(self, "rerank_weight", second)
        elif self.rerank_exact is not None:
            raise ValueError(f"{self.rerank_exact!r} re-orders nothing without a second stage")
        if weight == 1:
            object.__setattr__(self, "exact", EXACT_SCORES[0])

    @property
    def fitted(self) -> str | None:
        """The purpose of the channel metric this score weighs (`fitted_score`), if it weighs one."""
        return fitted_purpose(self.exact) if self.w2t_weight < 1 else None

    @property
    def first_stage(self) -> SearchScore:
        """The mix alone, without a second stage: the similarity a kNN votes by."""
        return replace(self, rerank_weight=None, rerank_top=10, rerank_exact=None)

    @property
    def second_stage(self) -> SearchScore | None:
        """The mix the top of the first stage is re-ordered by, if any."""
        return None if self.rerank_weight is None else SearchScore(self.rerank_exact or self.exact, self.rerank_weight)

    @property
    def name(self) -> str:
        """`dw`, `module`, `input_gram`, `w2t`, `dw+w2t@0.3`, or `module+w2t@0.8 then top 10 by module+w2t@0.1`."""
        second = self.second_stage
        if second is not None:
            return f"{self.first_stage.name}{_THEN}{self.rerank_top}{_BY}{second.name}"
        if self.w2t_weight == 0:
            return self.exact
        return _W2T if self.w2t_weight == 1 else f"{self.exact}{_MIX}{self.w2t_weight:g}"

    @classmethod
    def parse(cls, name: str) -> SearchScore:
        """The search score named `name` (ValueError for a name `name` does not write)."""
        first, then, rest = name.partition(_THEN)
        top, by, second = rest.partition(_BY)
        score: SearchScore | None
        try:
            score = cls._parse_mix(first)
            if then:
                stage = cls._parse_mix(second)
                score = cls(score.exact, score.w2t_weight, stage.w2t_weight, int(top), stage.exact) if by else None
        except ValueError:
            score = None
        if score is None or score.name != name:
            raise ValueError(
                f"not a search score: {name!r} (one of {', '.join((*EXACT_SCORES, *REFERENCED))}, {fitted_score('search')}, "
                f"{fused_score('search')}, {_W2T}, e.g. dw{_MIX}0.3, or e.g. module{_MIX}0.8{_THEN}10{_BY}module{_MIX}0.1)"
            )
        return score

    @classmethod
    def _parse_mix(cls, name: str) -> SearchScore:
        if name == _W2T:
            return cls(EXACT_SCORES[0], 1.0)
        exact, mix, weight = name.partition(_MIX)
        return cls(exact, float(weight) if mix else 0.0)

    def similarity(self, exact: np.ndarray | float, w2t_cosine: np.ndarray) -> np.ndarray:
        """The first stage's mix from its exact score and the W2T cosine (`exact` may be 0.0 where the weight is 1)."""
        return hybrid_score(exact, w2t_cosine, self.w2t_weight)

    def ranking(
        self, exact: np.ndarray | float, w2t_cosine: np.ndarray, excluded: np.ndarray | None = None, rerank_exact: np.ndarray | None = None
    ) -> np.ndarray:
        """Keys that order a gallery as this search does (rows: queries; higher first): the similarity, or with a
        second stage rerank_keys of both mixes (`rerank_exact`: the values of the second stage's exact score where it
        is not the first's). `excluded` (a mask like the scores) marks what a row may not return, e.g. the query
        itself: -inf, never in the top a second stage re-orders."""
        first = self.similarity(exact, w2t_cosine)
        if excluded is not None:
            first = np.where(excluded, -np.inf, first)
        second = self.second_stage
        if second is None:
            return first
        reordered_by = exact if self.rerank_exact is None else rerank_exact
        if reordered_by is None:
            raise ValueError(f"{self.name} re-orders by {self.rerank_exact}: its values are needed")
        return rerank_keys(first, second.similarity(reordered_by, w2t_cosine), self.rerank_top)


def _exactly_written(value: float, what: str) -> float:
    """A positive number its name writes exactly (`:g`), as a float; a ValueError naming `what` otherwise."""
    v = float(value)
    if not (np.isfinite(v) and v > 0 and float(f"{v:g}") == v):
        raise ValueError(f"{what} is a positive number its name writes exactly, not {value!r}")
    return v


@dataclass(frozen=True)
class KnnPredictor:
    """A similarity-weighted vote (or mean) of the k most similar labelled adapters by a search score: each
    neighbour weighed by max(s, 0) + 1e-6, or with a `temperature` T by the softmax of s / T
    (embed.selection.metrics.knn_weights); with a `width` h, each weight also times exp(−Δ² / 2h²), Δ the gap between
    the neighbour's update size and the query's (zoo.domain.sizes.update_size): a metric's neighbours trained about
    as far. T and h are positive and written exactly by the name (`:g`). A metric's kNN that follows its `trend` adds
    to the neighbours' mean a slope times the gap between the query's update profile (zoo.domain.sizes.PROFILE: its
    size and how its modules' spectra lie) and the neighbours' weighed mean profile: the slope, fitted on the labelled
    adapters' leave-one-out residuals (embed.selection.metrics.trend_slope), is the checkpoint's
    (W2TEnsemble.trend_slopes), not the name's."""

    similarity: SearchScore
    k: int
    temperature: float | None = None
    width: float | None = None
    trend: bool = False
    #: what checkpoints and `zoo predict` record as the predictor's kind
    kind: ClassVar[str] = "knn"

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"a kNN needs at least one neighbour, not {self.k!r}")
        if self.similarity.second_stage is not None:
            raise ValueError(f"a kNN votes by one similarity, not by the two stages of {self.similarity.name}")
        if self.temperature is not None:
            object.__setattr__(self, "temperature", _exactly_written(self.temperature, "a kNN's temperature"))
        if self.width is not None:
            object.__setattr__(self, "width", _exactly_written(self.width, "a kNN's size width"))

    @property
    def name(self) -> str:
        """`knn dw k=3`, `knn module+w2t@0.1 k=10`, `knn input_gram k=10 T=0.01`, `knn centred_gram k=30 T=0.01 h=2.8`,
        `knn module_centred k=10 trend`."""
        tempered = "" if self.temperature is None else f"{_T}{self.temperature:g}"
        sized = "" if self.width is None else f"{_H}{self.width:g}"
        return f"{_KNN}{self.similarity.name}{_K}{self.k}{tempered}{sized}{_TREND if self.trend else ''}"

    @classmethod
    def parse(cls, name: str) -> KnnPredictor:
        """The kNN predictor named `name` (ValueError for a name `name` does not write)."""
        trend = name.endswith(_TREND)
        body = name.removeprefix(_KNN).removesuffix(_TREND)
        rest, sized, h = body.rpartition(_H)
        if not sized:
            rest, h = body, ""
        head, tempered, t = rest.rpartition(_T)
        if tempered:
            rest = head
        similarity, _, k = rest.rpartition(_K)
        try:
            predictor = cls(SearchScore.parse(similarity), int(k), float(t) if tempered else None, float(h) if sized else None, trend)
        except ValueError:
            predictor = None
        if predictor is None or predictor.name != name:
            raise ValueError(f"not a kNN predictor: {name!r} (e.g. {_KNN}dw{_K}3, or {_KNN}input_gram{_K}10{_T}0.01)")
        return predictor


#: the learned predictors: the W2T heads, a kNN in the W2T embedding (metrics), few-shot readouts of it (attributes)
LEARNED = ("head", "neighbours", "prototype", "logreg")


@dataclass(frozen=True)
class LearnedPredictor:
    """A predictor trained with the W2T embedding, by kind (one of LEARNED); its name is its kind."""

    kind: str

    def __post_init__(self) -> None:
        if self.kind not in LEARNED:
            raise ValueError(f"no learned predictor {self.kind!r}; one of {', '.join(LEARNED)}")

    @property
    def name(self) -> str:
        return self.kind

    @classmethod
    def parse(cls, name: str) -> LearnedPredictor:
        """The learned predictor of kind `name` (ValueError for any other name)."""
        if name not in LEARNED:
            raise ValueError(f"not a learned predictor: {name!r} (one of {', '.join(LEARNED)})")
        return cls(name)


HEAD, NEIGHBOURS, PROTOTYPE, LOGREG = (LearnedPredictor(kind) for kind in LEARNED)

#: a target's predictor
Predictor: TypeAlias = KnnPredictor | LearnedPredictor


def parse_predictor(name: str) -> Predictor:
    """A predictor by its name: `knn dw k=3` or a learned one's kind."""
    if name.startswith(_KNN):
        return KnnPredictor.parse(name)
    try:
        return LearnedPredictor.parse(name)
    except ValueError:
        raise ValueError(f"not a predictor: {name!r} (one of {', '.join(LEARNED)}, or e.g. {_KNN}dw{_K}3)") from None
