"""The methods `zoo train` chooses among (embed/choice.py), as values: a search score and a target's predictor.

Their names (`dw`, `module+w2t@0.3`, `w2t`; `knn dw k=3`, `head`) are what checkpoints, the JSON of `zoo train`,
`zoo eval` and `zoo predict`, and the REST API carry: `name` writes one, `parse` reads one back (a ValueError for
anything `name` does not write), and each value has one name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TypeAlias

from zoo.domain.similarity import EXACT_SCORES

_W2T = "w2t"
_MIX = "+w2t@"
_KNN = "knn "
_K = " k="


@dataclass(frozen=True)
class SearchScore:
    """An exact score (zoo.domain.similarity.EXACT_SCORES) mixed with the supervised W2T cosine at `w2t_weight`:
    0 the exact score alone, 1 the W2T cosine alone (which mixes in no exact score: its `exact` is always the first).
    A weight is one its name writes exactly (`:g`, six significant digits)."""

    exact: str = EXACT_SCORES[0]
    w2t_weight: float = 0.0

    def __post_init__(self) -> None:
        weight = float(self.w2t_weight)
        if self.exact not in EXACT_SCORES or not 0 <= weight <= 1 or float(f"{weight:g}") != weight:
            raise ValueError(f"no search score mixes exact score {self.exact!r} with the W2T cosine at {self.w2t_weight!r}")
        object.__setattr__(self, "w2t_weight", weight)
        if weight == 1:
            object.__setattr__(self, "exact", EXACT_SCORES[0])

    @property
    def name(self) -> str:
        """`dw`, `module`, `w2t`, or `dw+w2t@0.3`."""
        if self.w2t_weight == 0:
            return self.exact
        return _W2T if self.w2t_weight == 1 else f"{self.exact}{_MIX}{self.w2t_weight:g}"

    @classmethod
    def parse(cls, name: str) -> SearchScore:
        """The search score named `name` (ValueError for a name `name` does not write)."""
        if name == _W2T:
            return cls(EXACT_SCORES[0], 1.0)
        exact, mix, weight = name.partition(_MIX)
        try:
            score = cls(exact, float(weight) if mix else 0.0)
        except ValueError:
            score = None
        if score is None or score.name != name:
            raise ValueError(f"not a search score: {name!r} (one of {', '.join(EXACT_SCORES)}, {_W2T}, or e.g. dw{_MIX}0.3)")
        return score


@dataclass(frozen=True)
class KnnPredictor:
    """A similarity-weighted vote (or mean) of the k most similar labelled adapters by a search score."""

    similarity: SearchScore
    k: int
    #: what checkpoints and `zoo predict` record as the predictor's kind
    kind: ClassVar[str] = "knn"

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"a kNN needs at least one neighbour, not {self.k!r}")

    @property
    def name(self) -> str:
        """`knn dw k=3`, `knn module+w2t@0.1 k=10`."""
        return f"{_KNN}{self.similarity.name}{_K}{self.k}"

    @classmethod
    def parse(cls, name: str) -> KnnPredictor:
        """The kNN predictor named `name` (ValueError for a name `name` does not write)."""
        similarity, _, k = name.removeprefix(_KNN).rpartition(_K)
        try:
            predictor = cls(SearchScore.parse(similarity), int(k))
        except ValueError:
            predictor = None
        if predictor is None or predictor.name != name:
            raise ValueError(f"not a kNN predictor: {name!r} (e.g. {_KNN}dw{_K}3)")
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
