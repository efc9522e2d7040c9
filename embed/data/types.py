"""Plain data of an embedding space: its module vocabulary and its adapters in memory (no SQL, no I/O).

An embedding space is a base model and its set of module shapes; adapters that lack some of
the space's modules are kept (their missing modules are masked), adapters with a module the
space does not know do not fit it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from zoo.domain.naming import layer_index, module_type

if TYPE_CHECKING:
    from zoo.domain.canonical import CanonicalFactors


@dataclass(frozen=True)
class SpaceSchema:
    """The module vocabulary of an embedding space, in a fixed order."""

    base_model: str
    modules: tuple[tuple[str, int, int], ...]  # (name, out, in), sorted by name

    @property
    def module_names(self) -> list[str]:
        return [m[0] for m in self.modules]

    @staticmethod
    def type_key(name: str, out: int, inp: int) -> str:
        """Modules sharing projections: same type and shape (BERT has three `dense` shapes)."""
        return f"{module_type(name)}@{out}x{inp}"

    def type_shapes(self) -> dict[str, tuple[int, int]]:
        """Shape per module type key (see type_key)."""
        return {self.type_key(n, o, i): (o, i) for n, o, i in self.modules}

    def layer_of(self, name: str) -> int:
        return layer_index(name) or 0

    def fits(self, factors: dict[str, CanonicalFactors]) -> bool:
        known = {n: (o, i) for n, o, i in self.modules}
        return all(n in known and known[n] == (int(f.U.shape[0]), int(f.V.shape[0])) for n, f in factors.items())

    def as_dict(self) -> dict[str, object]:
        return {"base_model": self.base_model, "modules": [list(m) for m in self.modules]}

    @classmethod
    def from_dict(cls, d: dict) -> SpaceSchema:
        return cls(d["base_model"], tuple((str(n), int(o), int(i)) for n, o, i in d["modules"]))


@dataclass
class ZooAdapter:
    id: int
    name: str
    factors: dict[str, CanonicalFactors]
    labels: dict[str, str] = field(default_factory=dict)
    measurements: dict[str, float] = field(default_factory=dict)
    source_uri: str = ""


def schema_of(base_model: str, adapters: list[ZooAdapter]) -> SpaceSchema:
    """The union of module shapes over the adapters (see `schema_from_shapes`)."""
    counts: dict[tuple[str, int, int], list[int]] = {}
    for a in adapters:
        for name, f in a.factors.items():
            seen = counts.setdefault((name, int(f.U.shape[0]), int(f.V.shape[0])), [0, a.id])
            seen[0] += 1
            seen[1] = min(seen[1], a.id)
    return schema_from_shapes(base_model, [(n, o, i, c, first) for (n, o, i), (c, first) in counts.items()])


def schema_from_shapes(base_model: str, shapes: list[tuple[str, int, int, int, int]]) -> SpaceSchema:
    """The space of (name, out, in, adapters with that shape, the first such adapter's id) rows. A module name seen
    with two shapes takes the shape most adapters give it (on a tie, the one of the lowest adapter id): adapters
    with the other shape do not fit the space (`SpaceSchema.fits`) and are left out of it, never breaking it for
    the others."""
    chosen: dict[str, tuple[int, int, int, int]] = {}
    for name, out, inp, count, first in shapes:
        best = chosen.get(name)
        if best is None or (count, -first) > (best[2], -best[3]):
            chosen[name] = (out, inp, count, first)
    return SpaceSchema(base_model, tuple(sorted((n, o, i) for n, (o, i, _, _) in chosen.items())))


def split_positions(adapters: list[ZooAdapter], test_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A seeded split by adapter: (train, test) positions in `adapters`, each in input order.

    It is drawn over the adapters sorted by name (then id), so it does not depend on the order in
    which they were stored: the same zoo ingested again splits the same way.
    """
    by_name = sorted(range(len(adapters)), key=lambda p: (adapters[p].name, adapters[p].id))
    order = np.random.default_rng(seed).permutation(len(by_name))
    n_test = max(1, int(round(test_fraction * len(by_name))))
    test = sorted(by_name[i] for i in order[:n_test])
    train = sorted(by_name[i] for i in order[n_test:])
    return train, test
